"""Numbers from a Recorder: the observations of the H2O and RoCo papers, per layer."""

from __future__ import annotations

import math

import torch


def sparsity(rec) -> dict[int, float]:
    """Per layer: share of attention scores below 1% of their row maximum."""
    return {i: st.below / st.visible for i, st in sorted(rec.layers.items())}


def power_law_slope(acc: torch.Tensor, skip: int = 1) -> float:
    """Least-squares slope of log(score) vs log(rank) of the accumulated attention sorted in
    decreasing order (a straight line on the log-log plot = a power law; H2O paper Fig. 2).
    ``skip`` leaves out the first ranks (the attention sink dominates rank 1)."""
    vals = acc.sort(descending=True).values
    vals = vals[vals > 0]
    if len(vals) <= skip + 2:
        return float("nan")
    y = vals[skip:].double().log()
    x = torch.arange(skip + 1, len(vals) + 1, dtype=torch.float64).log()
    xm, ym = x.mean(), y.mean()
    return float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())


def heavy_hitter_overlap(rec, layer: int, frac: float = 0.1) -> list[tuple[int, float]]:
    """For consecutive checkpoints t < t': the share of the top-k keys (k = frac * t, by
    accumulated attention up to t) that are still the top-k at t' when ranking the same keys
    (those < t) by accumulated attention up to t'. 1.0 = the heavy hitters never change."""
    snaps = rec.layers[layer].snapshots
    ts = sorted(snaps)
    out = []
    for t, t2 in zip(ts, ts[1:]):
        k = max(1, int(frac * t))
        a = set(snaps[t].topk(k).indices.tolist())
        b = set(snaps[t2][:t].topk(k).indices.tolist())
        out.append((t2, len(a & b) / k))
    return out


def running_std(trace: torch.Tensor, start: int) -> torch.Tensor:
    """std(a_start(i), ..., a_t(i)) for t = start..n-1 (RoCo paper, Fig. 3: it settles)."""
    x = trace[start:].double()
    k = torch.arange(1, len(x) + 1, dtype=torch.float64)
    mean = x.cumsum(0) / k
    var = (x.square().cumsum(0) / k - mean.square()).clamp_min(0)
    return var.sqrt()


def settle_ratio(std: torch.Tensor) -> float:
    """How much the running std still moves in the second half of its trace relative to the
    first: mean |Δstd| over the last half / mean |Δstd| over the first half (< 1: settling)."""
    d = std.diff().abs()
    h = len(d) // 2
    if h < 2:
        return math.nan
    first, last = d[:h].mean().item(), d[h:].mean().item()
    return last / first if first > 0 else math.nan
