"""Token budgets, each a declared type (a ``Budget``) with one ``resolve(n)``: the tokens kept per
(sequence, KV head) once the prompt's length n is known.

    Tokens(k).resolve(n)    = k
    Fraction(s).resolve(n)  = max(1, ceil(s n))                      s in (0, 1]
    MemoryPlan.resolve(n)   = max(floor, B(n))                       a memory budget's share

where B(n) is the B that spends the plan's bytes (``kvevict.memory.MemoryPlan``): sum_l min(cap_l,
B) r = m sum_l kept_l(n) on a model with sliding layers, ceil(s n) otherwise. A user's int is
``Tokens`` and a float ``Fraction`` (``as_budget``, where a budget is resolved); a policy may give
each layer its own (PyramidKV, ``layer_budgets``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .policies import Policy


class Budget:
    """A token budget of a declared type: ``Tokens``, ``Fraction`` or a memory plan's share
    (``kvevict.memory.MemoryPlan``), each resolving itself against the prompt's length."""

    def resolve(self, prompt_len: int) -> int:
        """The tokens kept per (sequence, KV head) of a ``prompt_len``-token prompt."""
        raise NotImplementedError


@dataclass(frozen=True)
class Tokens(Budget):
    """``count`` tokens per (sequence, KV head), whatever the prompt's length."""

    count: int

    def resolve(self, prompt_len: int) -> int:
        return self.count


@dataclass(frozen=True)
class Fraction(Budget):
    """A share s in (0, 1] of an n-token prompt: max(1, ceil(s n)) tokens (less 1e-9 so that a
    float's error never adds a token: 0.2 x 25 is 5)."""

    share: float

    def resolve(self, prompt_len: int) -> int:
        return max(1, math.ceil(self.share * prompt_len - 1e-9))


def as_budget(budget) -> Budget:
    """A budget as its declared type: an int is ``Tokens``, a float ``Fraction``; a ``Budget``
    (a memory plan's share, a float too) as given."""
    if isinstance(budget, Budget):
        return budget
    return Fraction(budget) if isinstance(budget, float) else Tokens(budget)


def resolve_budget(budget, prompt_len: int) -> int:
    """The tokens ``budget`` keeps of a ``prompt_len``-token prompt (``as_budget(budget).resolve``)."""
    return as_budget(budget).resolve(prompt_len)


def check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(
            f"budget must be an int (tokens) or a float in (0, 1] (fraction of the prompt), got {budget!r}."
        )
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(
            f"a float budget is a fraction of the prompt length and must be in (0, 1], got {budget}; "
            "pass an int for a number of tokens."
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}.")


def layer_budgets(policy: Policy, budget, num_layers: int, windows: list | None = None) -> list:
    """One budget per layer: uniform, or the policy's own schedule (``Policy.layer_budgets``:
    PyramidKV). A fractional budget stays fractional, scaled per layer, and is resolved against
    the prompt length. ``windows``: the layers' sliding windows (None: global), for a policy
    recorded on the prompt (kvzip, ``Policy.prompt_tokens``): its pool holds what budget B would
    hold layer by layer, sum_l min(B, kept_l), no layer past kept_l."""
    known = policy.prompt_tokens  # a policy recorded on the prompt (kvzip)
    resolved = resolve_budget(budget, known) if isinstance(budget, float) and known else budget
    schedule: list | None  # None: the policy has none, every layer ``budget``
    if known and windows and any(w is not None for w in windows):
        caps = [known if w is None else min(known, w - 1) for w in windows]
        schedule = policy.layer_budgets(resolved, num_layers, caps=caps)
    elif isinstance(resolved, float):  # a share: the schedule of a large nominal budget, scaled
        nominal = 1 << 20
        scaled = policy.layer_budgets(nominal, num_layers)
        schedule = None if scaled is None else [resolved * b / nominal for b in scaled]
    else:
        schedule = policy.layer_budgets(resolved, num_layers)
    return [budget] * num_layers if schedule is None else schedule


# Eviction in batches by default: a layer ranks once every SLACK steps, or every budget / SHARE
# steps when that is fewer, so a turn-over never evicts more than a sixteenth of what a layer keeps
# (docs/results/families.md, "Evicting in batches"). A layer of fewer than 2 x SHARE tokens
# evicts one a step.
SLACK = 16
SLACK_SHARE = 16


def default_slack(budget: int) -> int:
    """The slack a layer of ``budget`` tokens (its own: PyramidKV's, a window's) evicts in."""
    return max(1, min(SLACK, budget // SLACK_SHARE))
