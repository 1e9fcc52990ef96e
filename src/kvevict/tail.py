"""A first prompt under a policy whose statistics come from its last queries only: how many of
them ``attention.attend`` must score itself, and SDPA's output for the others."""

from __future__ import annotations

import torch

from .stats import stat


def scored_tail(seg, q, n_past, window, softcap, wanted, observe) -> int:
    """How many of the last queries ``attend`` must score itself: all ``q``, unless the forward is a
    first prompt with nothing stored, unpadded, without sliding window, softcap or summary, and
    every statistic wanted comes from the last queries only (``Stat.scored``: ``observe`` for
    "obs" and "max", 1 for "last", 0 where none comes from scores); then the most they ask for,
    and SDPA gives the other queries' output."""
    if q == 1 or n_past or seg.summary is not None or seg.valid_new is not None or window is not None:
        return q
    if softcap is not None:
        return q
    tails = [stat(n).scored(observe) for n in wanted]
    if None in tails:
        return q
    return min(q, max(tails, default=0))


def sdpa_causal(query, k, v, scale):
    """(b, hq, q, d) causal attention of ``q`` queries over their own ``q`` keys, by torch's fused
    SDPA, which materialises no scores. Each KV head is repeated for its query heads (a copy of
    the keys and values, O(q)): SDPA's own ``enable_gqa`` is served by its math backend alone on
    some builds, which builds the q x q scores."""
    b, hq, q, d = query.shape
    g = hq // k.shape[1]
    if g > 1:
        k, v = (x[:, :, None].expand(b, x.shape[1], g, q, x.shape[-1]).reshape(b, hq, q, x.shape[-1]) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale)
