"""What a policy is: an importance score and an eviction scope (RoCo / EasyKV's decomposition,
Ren & Zhu 2024, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language
Model Inference"). The selection machinery is written once, in ``priority`` below and in the cache.

A policy sees the candidates of one eviction decision, per (sequence, KV head), as ``Candidates``
and returns, per candidate, a score (higher = keep) and whether it lies inside the eviction scope.
The cache keeps the ``budget`` candidates of highest priority, where

    priority = -inf         for padding and empty slots (never kept over a real token)
             = +inf         outside the eviction scope (recent window, sinks, ...)
             = score        otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

INF = float("inf")


@dataclass
class Candidates:
    """Per-candidate state of one decision, each tensor (batch, kv_heads, n)."""

    stats: dict[str, torch.Tensor]  # the statistics the policy asked for (see attention.py)
    pos: torch.Tensor  # position of the token in its sequence (0 = first real token)
    valid: torch.Tensor  # False for padding and empty slots
    newest: torch.Tensor  # (batch, 1, 1): position of the newest token of each sequence
    budget: int
    layer_idx: int


@dataclass
class Policy:
    """Base policy: keep ``recent`` newest tokens and ``sinks`` first ones, rank the rest by ``score``.

    ``recent=None`` means half the budget (H2O's 10% + 10% split of a 20% budget).
    """

    recent: int | None = None
    sinks: int = 0

    name: ClassVar[str] = "base"
    # each candidate's priority depends on its own state only (not on its neighbours'), so a
    # protected newcomer can be left out of the ranking without changing the choice
    independent: ClassVar[bool] = True
    # statistics the attention must collect for this policy (see kvevict.attention)
    stats: ClassVar[tuple[str, ...]] = ()

    def score(self, c: Candidates) -> torch.Tensor:
        raise NotImplementedError

    def attention_params(self) -> dict:
        """Extra parameters the attention needs to collect this policy's statistics."""
        return {}

    def decay(self) -> float:
        """Per-token decay of the "hits_ema" statistic (1.0 = none)."""
        return 1.0

    def protected(self, c: Candidates) -> torch.Tensor:
        """Candidates outside the eviction scope: the recent window and the sinks."""
        keep = c.pos > c.newest - self.recent_for(c.budget)
        if self.sinks:
            keep = keep | (c.pos < self.sinks)
        return keep

    def recent_for(self, budget: int) -> int:
        return budget // 2 if self.recent is None else self.recent

    def keeps_newest(self, budget: int) -> bool:
        """True when the token just written can never be its own step's victim (saves a gather)."""
        return self.recent_for(budget) >= 1

    def priority(self, c: Candidates) -> torch.Tensor:
        prio = torch.where(self.protected(c), INF, self.score(c).float())
        return prio.masked_fill(~c.valid, -INF)

    def check(self, budget: int) -> None:
        """Raise a clear error when the parameters cannot work with this budget."""
        recent = self.recent_for(budget)
        if recent < 0:
            raise ValueError(f"recent must be >= 0, got {recent}.")
        if recent >= budget:
            raise ValueError(
                f"recent={recent} must be smaller than the budget ({budget} tokens): the recent window "
                "would take the whole cache and leave nothing to rank. Lower recent or raise the budget."
            )
        if self.sinks < 0 or self.sinks + recent > budget:
            raise ValueError(f"sinks={self.sinks} + recent={recent} must fit in the budget ({budget}).")
