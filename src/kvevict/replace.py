"""How a tier out of room takes new entries in (``Tier.insert``): in a decode step the new token
takes the slot of the lowest-priority candidate (``replace_one``); a prompt's chunk evicts the m
lowest of the slots and its m entries and moves the kept entries into the evicted slots, pairwise
(``replace_many``), so storage is overwritten in place; ``evicted`` gathers what left, for a
second tier or the merged slot. Eviction in batches is ``kvevict.turnover``'s."""

from __future__ import annotations

from typing import Any

import torch

from .storage.rect import expand_index, trailing

# the tier whose slots are replaced (``kvevict.tier.Tier``: not imported, which imports this module)
Tier = Any


def replace_one(tier: Tier, policy, new, ctx, protected_newcomer, want_evicted):
    """Decoding: the new token takes the slot of the lowest-priority candidate."""
    B = tier.capacity
    if protected_newcomer and policy.keeps_newest(ctx["budget"]) and policy.independent:
        # the newcomer is protected and cannot change the others' ranks: rank the slots only
        slot, take = tier.priority(policy, None, ctx).argmin(-1, keepdim=True), None
    else:
        victim = tier.priority(policy, new, ctx).argmin(-1, keepdim=True)  # (b, h, 1)
        slot, take = victim.clamp(max=B - 1), victim < B
    gone = tier.read(slot) if want_evicted else None
    if gone is not None and take is not None:  # where the newcomer lost, it is what leaves
        gone = {n: torch.where(trailing(take, t), t, new[n]) for n, t in gone.items()}
    tier.write(slot, new, take)
    return gone


def replace_many(tier: Tier, policy, new, ctx, want_evicted, all_real=False):
    """Prefill chunks: evict the m lowest-priority of the B slots + m new tokens; the kept new
    tokens move into the evicted slots, pairwise, so storage is overwritten in place."""
    B, m = tier.capacity, new["pos"].shape[-1]
    prio = tier.priority(policy, new, ctx)
    # empty slots go first in slot order (topk breaks ties arbitrarily), so a row fills its
    # slots in order and never writes past its fill
    order = torch.arange(prio.shape[-1], device=prio.device, dtype=torch.float32)
    prio = torch.where(prio == -float("inf"), order * 1e32 - 3e38, prio)
    out = prio.topk(m, dim=-1, largest=False).indices  # (b, h, m) evicted candidates
    gone = evicted(tier, out, new, all_real) if want_evicted else None
    ev_slot = torch.zeros(prio.shape[0], prio.shape[1], B + m, dtype=torch.bool, device=prio.device)
    ev_slot.scatter_(-1, out, True)
    k = min(m, B)
    # evicted slots first, then kept ones (stable); kept new tokens first, then evicted ones
    targets = torch.argsort((~ev_slot[..., :B]).to(torch.int8), dim=-1, stable=True)[..., :k]
    sources = torch.argsort(ev_slot[..., B:].to(torch.int8), dim=-1, stable=True)[..., :k]
    n_moves = ev_slot[..., :B].sum(-1, keepdim=True)  # = number of kept new tokens
    move = torch.arange(k, device=prio.device).view(1, 1, k) < n_moves  # (b, h, k)
    moved = {n: t.gather(2, expand_index(sources, t)) for n, t in new.items()}
    tier.write(targets, moved, move)
    return gone


def evicted(tier: Tier, out, new: dict, all_real: bool = False) -> dict:
    """The entries of evicted candidates ``out`` (indices into slots + new), valid ones first,
    cut to the most valid ones any (sequence, head) has (every one, with ``all_real``)."""
    B = tier.capacity
    from_slot = out < B
    stored = tier.read(out.clamp(max=B - 1))
    fresh = {n: t.gather(2, expand_index((out - B).clamp(min=0), t)) for n, t in new.items()}
    got = {n: torch.where(trailing(from_slot, stored[n]), stored[n], fresh[n]) for n in stored}
    if all_real:
        return got
    valid = got["pos"] >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    keep = int(valid.sum(-1).max())
    order = order[..., :keep]
    return {n: t.gather(2, expand_index(order, t)) for n, t in got.items()}
