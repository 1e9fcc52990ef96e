"""Token budgets: an int is tokens per (sequence, KV head); a float in (0, 1] is that share of
the prompt; a policy may give each layer its own (PyramidKV)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .policies import Policy


def resolve_budget(budget, prompt_len: int) -> int:
    """An int budget is tokens; a float in (0, 1] is that fraction of the prompt length (a memory
    plan's ``PromptShare`` resolves itself: its floor, sliding layers)."""
    if hasattr(budget, "tokens"):
        return budget.tokens(prompt_len)
    if isinstance(budget, float):
        return max(1, math.ceil(budget * prompt_len - 1e-9))
    return budget


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
    """One budget per layer: uniform, or the policy's own schedule (PyramidKV). A fractional budget
    stays fractional, scaled per layer, and is resolved against the prompt length. ``windows``: the
    layers' sliding windows (None: global), for a policy recorded on the prompt (kvzip): its pool
    holds what budget B would hold layer by layer, sum_l min(B, kept_l), no layer past kept_l."""
    schedule = getattr(policy, "layer_budgets", None)
    if schedule is None:
        return [budget] * num_layers
    known = getattr(policy, "prompt_tokens", None)  # a policy recorded on the prompt (kvzip)
    if isinstance(budget, float) and known:
        budget = resolve_budget(budget, known)
    if known and windows and any(w is not None for w in windows):
        return schedule(budget, num_layers, caps=[known if w is None else min(known, w - 1) for w in windows])
    if isinstance(budget, float):
        nominal = 1 << 20
        return [budget * b / nominal for b in schedule(nominal, num_layers)]
    return schedule(budget, num_layers)


# Eviction in batches by default: a layer ranks once every SLACK steps, or every budget / SHARE
# steps when that is fewer, so a turn-over never evicts more than a sixteenth of what a layer keeps
# (docs/results/families.md, "Evicting in batches"). A layer of fewer than 2 x SHARE tokens
# evicts one a step.
SLACK = 16
SLACK_SHARE = 16


def default_slack(budget: int) -> int:
    """The slack a layer of ``budget`` tokens (its own: PyramidKV's, a window's) evicts in."""
    return max(1, min(SLACK, budget // SLACK_SHARE))
