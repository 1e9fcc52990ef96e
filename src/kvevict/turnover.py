"""Eviction in batches: one tier's turn-over state (``slack``) and, for a packed tier, its recent
tier of tokens waiting in 16 bits.

A full tier ranks once every ``slack`` steps: the ranking evicts the ``slack x m`` lowest-priority
candidates at once (``m`` entries a step: 1, or a pooled tier's heads), the kept new entries take
the first freed slots and the other ``(slack - 1) x m`` are emptied, then taken in order by the
next ``slack - 1`` steps with nothing ranked. The tier never holds more than its budget, and
``slack = 1`` is one eviction a step exactly (TriAttention and kvpress's DecodingPress compress
every N steps in the same way).

A packed tier's steps between rankings would each quantize one token. Instead the tokens wait in a
recent tier in 16 bits (KIVI's residual, Liu et al. 2024) and are quantized as one group into the
slots they stand for at the next ranking (``flush``): the same codes as one by one, since a token's
groups are its own channels.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .budget import default_slack
from .stats import stat_bytes
from .storage import Storage
from .storage.rect import expand_index

# the tier whose slots turn over (``kvevict.tier.Tier``: not imported, which imports this module)
Tier = Any
RECENT_SHARE = 16  # a recent tier costs at most 1 / 16 of the bytes of the tokens kept


def recent_slots(storage: Storage, slack: int, dims: tuple[int, int], dtype, stats, pooled: bool) -> int:
    """The slots of ``storage`` a recent tier's bytes take (slack - 1 tokens a head at 16 bits),
    which a memory budget gives up so that it holds them too."""
    dk, dv = dims
    extra = stat_bytes(stats) + (1 if pooled else 0)  # a pooled slot's head id
    dense = Storage(kv_bits=16).slot_bytes(dk, dv, 2, extra)
    packed = storage.slot_bytes(dk, dv, dtype.itemsize, extra)
    return math.ceil((slack - 1) * dense / packed)


def slack_and_recent(spec, storage: Storage, budget: int, dims, dtype, stats, pooled: bool, compact: bool):
    """(a layer's slack, the slots its recent tier costs: 0 for none). ``spec``: the layer's
    ``LayerSpec``. A share of a short prompt may leave fewer slots than the slack asked; a sliding
    layer's window moves a token a step, and what leaves it must leave at once (as the stock
    cache's). A packed layer keeps a recent tier where its bytes are at most a sixteenth of the kept
    tokens' (RECENT_SHARE) and, under a memory plan, which pays for it in slots, leave the plan's
    floor of tokens. A memory plan's default slack shrinks until its recent tier fits: a
    quantization every step costs more launches than a ranking every few steps saves, and the
    plan's bytes stay what they are."""
    slack = default_slack(budget) if spec.slack is None else min(spec.slack, budget)
    if spec.window is not None:
        return 1, 0
    if compact or slack < 2 or storage.kv_bits not in (8, 4, 2):
        return slack, 0
    for s in range(slack, 1 if spec.slack is None and spec.memory_plan else slack - 1, -1):
        cost = recent_slots(storage, s, dims, dtype, stats, pooled)
        if cost * RECENT_SHARE <= budget and budget - cost >= spec.floor:
            return s, cost
    return slack, 0


class Turnover:
    """Batch eviction's state for one tier: the slots the last ranking freed and how many steps
    took theirs, whether a slot below a row's fill is empty (``holes``: attention masks it), and
    the recent tier (made at the first ranking, so a tier that never fills holds no byte of it)."""

    def __init__(self, slack: int, recent_shape: tuple | None = None):
        self.slack = slack
        self.free: torch.Tensor | None = None  # (b, h, (slack - 1) x entries) the freed slots, in use order
        self.taken = 0  # steps that took their slots of ``free``
        self.holes = False
        self.recent: Any = None  # a Tier of 16-bit slots, or None
        # (slots, h, dk, dv, dtype, device, stats, heads) of the recent tier to make, or None
        self.recent_shape = recent_shape

    def between(self, m: int) -> bool:
        """Whether a step of ``m`` entries still has freed slots to take (no ranking)."""
        return self.free is not None and (self.taken + 1) * m <= self.free.shape[-1]

    def step(self, tier: Tier, policy, new: dict, ctx: dict, protected_newcomer: bool, want_evicted: bool):
        """One decode step of a full tier whose entries are all tokens: take freed slots, or rank
        and free ``slack x m`` at once. Returns what left (``want_evicted``), else None."""
        m = new["pos"].shape[-1]
        if self.between(m):  # no ranking: the entries to the recent tier, else to their slots
            assert self.free is not None
            j = self.taken * m
            if self.recent is not None:
                self.recent.put(j, new)
            else:
                tier.write(self.free[..., j : j + m], new, None)
                self.holes = (self.taken + 2) * m <= self.free.shape[-1]
            self.taken += 1
            return None
        self.flush(tier)
        n = self.slack * m
        if m == 1 and protected_newcomer and policy.keeps_newest(ctx["budget"]) and policy.independent:
            out = tier.priority(policy, None, ctx).topk(n, dim=-1, largest=False).indices  # slots only
            gone = tier.read(out) if want_evicted else None
            tier.write(out[..., :1], new, None)
            free = out[..., 1:]
        else:
            gone, free = self._rank(tier, policy, new, ctx, want_evicted, n)
        if n > m:
            tier.bookkeeping["pos"].write(free, torch.full_like(free, -1), None)
            self.free, self.taken, self.holes = free, 0, True
            self.make_recent(tier)
        return gone

    def _rank(self, tier: Tier, policy, new: dict, ctx: dict, want_evicted: bool, n: int):
        """One ranking of the slots and the new entries: the ``n`` lowest leave, the kept new
        entries take the first freed slots; (what left, the other freed slots)."""
        B, m = tier.capacity, new["pos"].shape[-1]
        prio = tier.priority(policy, new, ctx)
        out = prio.topk(n, dim=-1, largest=False).indices  # (b, h, n) evicted candidates
        gone = tier.evicted(out, new, all_real=not self.holes) if want_evicted else None
        ev = torch.zeros(*prio.shape, dtype=torch.bool, device=prio.device).scatter_(-1, out, True)
        # evicted slots first (in slot order), then kept ones; kept new entries first
        targets = torch.argsort((~ev[..., :B]).to(torch.int8), dim=-1, stable=True)[..., :n]
        sources = torch.argsort(ev[..., B:].to(torch.int8), dim=-1, stable=True)
        kept = (~ev[..., B:]).sum(-1, keepdim=True)  # (b, h, 1) new entries kept; the other evicted slots free
        moved = {k: t.gather(2, expand_index(sources, t)) for k, t in new.items()}
        tier.write(targets[..., :m], moved, torch.arange(m, device=prio.device) < kept)
        return gone, targets.gather(-1, kept + torch.arange(n - m, device=prio.device))

    def make_recent(self, tier: Tier) -> None:
        """The recent tier, if this tier is to have one and has none yet."""
        if self.recent_shape is None or self.recent is not None:
            return
        slots, h, dk, dv, dtype, device, stats, heads = self.recent_shape
        # 16 bits, as the stock cache the budgets are shares of: the model's dtype, or float16
        bits = 16 if dtype.itemsize > 2 else None
        self.recent = type(tier)(slots, len(tier.row_fills), h, dk, dv, dtype, device, stats, bits=bits, heads=heads)
        self.recent.grow_to(slots)

    def flush(self, tier: Tier) -> None:
        """The recent tier's tokens into the slots they stand for (the first of ``free``): keys and
        values quantized as one group, their bookkeeping with them; the recent tier empties."""
        r = self.recent
        if r is None or not r.filled:
            return
        assert self.free is not None, "a recent tier fills only between two rankings"
        n = r.filled
        got = {"k": r.store.keys[:, :, :n], "v": r.store.values[:, :, :n]}
        got.update({name: r.meta(name)[..., :n] for name in r.names()})
        tier.write(self.free[..., :n], got, None)
        r.meta("pos")[..., :n] = -1
        r.set_fills([0] * len(r.row_fills))
        self.holes = n < self.free.shape[-1]

    def settle(self, tier: Tier) -> None:
        """Before the batch changes: the recent tokens to their slots, and no recent tier any more
        (rows that join may be at another step of their turn-over)."""
        self.flush(tier)
        self.recent, self.recent_shape, self.free = None, None, None

    def nbytes(self) -> int:
        return 0 if self.recent is None else self.recent.nbytes()
