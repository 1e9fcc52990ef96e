"""What a policy is: an importance score and an eviction scope (RoCo / EasyKV's decomposition,
Ren & Zhu 2024, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language
Model Inference"). The selection machinery is written once, in ``priority`` below and in the cache.

A policy sees the candidates of one eviction decision, per (sequence, KV head), as ``Candidates``
and returns, per candidate, a score (higher = keep) and whether it lies inside the eviction scope.
The cache keeps the ``budget`` candidates of highest priority, where

    priority = -inf         for padding and empty slots (never kept over a real token)
             = +inf         outside the eviction scope (recent window, sinks, ...)
             = score        otherwise.

Two scope options every policy takes (per call, through ``make_cache``):

- ``question=N``: the prompt's last N tokens (its question) are never evicted, and policies with
  an observation window (SnapKV, expected attention) observe exactly them. It needs the question
  at prefill time: a cache compressed before the question is known cannot use it.
- ``adaptive=True`` (Ada-KV, see ``adakv.py``): a layer's ``kv_heads x budget`` slots are shared by
  its KV heads, filled by the top-(H x B) priorities of all heads jointly, each head keeping at
  least its ``floor`` share; ``Candidates.head`` then says whose each candidate is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..stats import stat

INF = float("inf")


@dataclass
class Candidates:
    """Per-candidate state of one decision, each tensor (batch, kv_heads, n)."""

    stats: dict[str, torch.Tensor]  # the statistics the policy asked for (see attention.py)
    pos: torch.Tensor  # position of the token in its sequence (0 = first real token)
    valid: torch.Tensor  # False for padding and empty slots
    newest: torch.Tensor  # (batch, 1, 1): position of the newest token of each sequence
    budget: int  # per KV head (the layer holds heads x budget slots when adaptive)
    layer_idx: int
    head: torch.Tensor | None = None  # (batch, 1, n) KV head of each candidate, adaptive layers only
    heads: int = 1  # KV heads sharing the candidates (adaptive) or 1
    prompt_len: torch.Tensor | None = None  # (batch, 1, 1) real tokens of each prompt (for ``question``)

    def seen(self) -> torch.Tensor:
        """n_i, how many queries have attended to each candidate: a kept key is seen by every query
        from its own position on (causal attention; padding adds no position), so n_i = newest -
        pos_i + 1 is read from positions instead of stored as a counter (4 bytes a slot)."""
        return (self.newest - self.pos + 1).clamp(min=1).float()

    def lookup(self, table: torch.Tensor) -> torch.Tensor:
        """``table`` (batch, kv_heads, n) read at each candidate's (head, position), positions
        clamped to [0, n): per-head scores recorded in advance (KVzip, the oracle)."""
        n = table.shape[-1]
        idx = self.pos.clamp(0, n - 1)
        if self.head is None:
            return table.gather(-1, idx)
        return table.flatten(1).unsqueeze(1).gather(-1, self.head.long() * n + idx)


@dataclass
class Policy:
    """Base policy: keep ``recent`` newest tokens and ``sinks`` first ones, rank the rest by ``score``.

    ``recent=None`` means half the budget (H2O's 10% + 10% split of a 20% budget).
    """

    recent: int | None = None
    sinks: int = 0
    question: int = 0  # the prompt's last tokens, protected and observed (set per call by make_cache)
    adaptive: bool = False  # Ada-KV head-adaptive budgets (see adakv.py)
    floor: float = 0.2  # adaptive: share of a head's rankable budget it always keeps
    merge: bool = False  # evicted tokens kept as one mean slot per head (kvevict.merge), not dropped

    name: ClassVar[str] = "base"
    # each candidate's priority depends on its own state only (not on its neighbours'), so a
    # protected newcomer can be left out of the ranking without changing the choice
    independent: ClassVar[bool] = True
    # statistics the attention must collect for this policy, by name (declared in kvevict.stats)
    stats: ClassVar[tuple[str, ...]] = ()
    # whether its candidates may mix KV heads (adaptive budgets): False when the scope ranks a row
    adaptable: ClassVar[bool] = True
    # scores the whole prompt in a pass of its own before the cache exists (kvzip): ``generate``
    # records it on the prompt first (``cls.record``), and a memory plan spends its bytes for it
    needs_prompt: ClassVar[bool] = False
    # built by recording a sequence (kvzip, the oracle: a classmethod ``record``), so it holds
    # per-sequence state and its rows share no cache with others; set for every class defining ``record``
    recorded: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("stats", ()):  # an undeclared statistic fails here, not mid-forward
            stat(name)
        if "record" in cls.__dict__:
            cls.recorded = True

    @property
    def prompt_tokens(self) -> int | None:
        """The length of the prompt the policy was recorded on (kvzip), None when it was not:
        fractional budgets resolve against it for ``layer_budgets``."""
        return None

    def layer_budgets(self, budget: int, num_layers: int, caps: list[int] | None = None) -> list[int] | None:
        """The policy's own budget per layer for a uniform ``budget`` (PyramidKV, kvzip's pool), or
        None: every layer ``budget`` (no schedule). ``caps``: the most each layer can hold (a
        sliding layer's window), given for a policy recorded on the prompt (``prompt_tokens``)."""
        return None

    def score(self, c: Candidates) -> torch.Tensor:
        raise NotImplementedError

    def attention_params(self) -> dict:
        """Extra parameters the attention needs to collect this policy's statistics."""
        return {}

    def decay(self) -> float:
        """Per-token decay of the "hits_ema" statistic (1.0 = none)."""
        return 1.0

    def protected(self, c: Candidates) -> torch.Tensor:
        """Candidates outside the eviction scope: the recent window, the sinks and the question."""
        return self.pinned(c, c.pos > c.newest - self.recent_for(c.budget))

    def pinned(self, c: Candidates, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` plus the sinks and the question (the prompt's last ``question`` tokens)."""
        if self.sinks:
            keep = keep | (c.pos < self.sinks)
        if self.question and c.prompt_len is not None:
            keep = keep | ((c.pos >= c.prompt_len - self.question) & (c.pos < c.prompt_len))
        return keep

    def observe(self, window: int) -> int:
        """Observation window: the question when one is given, else ``window`` last queries."""
        return self.question or window

    def recent_for(self, budget: int) -> int:
        return budget // 2 if self.recent is None else self.recent

    def keeps_newest(self, budget: int) -> bool:
        """True when the token just written can never be its own step's victim (saves a gather)."""
        return self.recent_for(budget) >= 1

    def priority(self, c: Candidates) -> torch.Tensor:
        prio = torch.where(self.protected(c), INF, self.score(c).float())
        prio = prio.masked_fill(~c.valid, -INF)
        if c.head is not None and self.floor_for(c.budget):
            prio = self._floored(prio, c)
        return prio

    def floor_for(self, budget: int) -> int:
        """Adaptive: ranked tokens each head keeps whatever the others score (Ada-KV's safeguard)."""
        return int(self.floor * (budget - self.recent_for(budget) - self.sinks - self.question))

    def _floored(self, prio: torch.Tensor, c: Candidates) -> torch.Tensor:
        """Each head's ``floor_for`` best in-scope candidates lifted out of the scope (+inf). Every
        head's top-k at once; a head with fewer than k in scope fills its top-k with other entries
        (-inf), which point at a spare column, so they never undo another head's lift."""
        n = prio.shape[-1]
        k = min(self.floor_for(c.budget), n)
        heads = torch.arange(c.heads, device=prio.device).view(-1, 1, 1, 1)
        mine = torch.where(torch.isfinite(prio) & (c.head == heads), prio, -INF)  # (heads, b, h, n)
        top = mine.topk(k, dim=-1)
        idx = torch.where(torch.isfinite(top.values), top.indices, n).movedim(0, -2).flatten(-2)
        lift = torch.zeros(*prio.shape[:-1], n + 1, dtype=torch.bool, device=prio.device)
        return prio.masked_fill(lift.scatter_(-1, idx, True)[..., :n], INF)

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
        if isinstance(self.question, bool) or not isinstance(self.question, int) or self.question < 0:
            raise ValueError(f"question must be an int number of prompt tokens >= 0, got {self.question!r}.")
        if self.sinks + recent + self.question > budget:
            raise ValueError(
                f"question={self.question} + recent={recent} + sinks={self.sinks} tokens are "
                f"protected, more than the budget ({budget}); raise the budget or protect fewer."
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {self.adaptive!r}.")
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not 0 <= self.floor <= 1:
            raise ValueError(f"floor must be a share of a head's budget in [0, 1], got {self.floor!r}.")
        if self.adaptive and not self.adaptable:
            raise ValueError(
                f"{self.name} cannot take adaptive budgets: its eviction scope ranks each head's "
                "tokens among themselves. Use h2o, snapkv, tova, knorm, expected, kvzip, ... instead."
            )
