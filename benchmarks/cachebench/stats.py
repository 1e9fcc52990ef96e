"""Summaries of repeated timings: median and spread (min, max, interquartile range)."""

from __future__ import annotations

import statistics


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty list."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: list[float]) -> dict:
    """{'median', 'min', 'max', 'q1', 'q3', 'n'} of the samples."""
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": quantile(xs, 0.25),
        "q3": quantile(xs, 0.75),
        "n": len(xs),
    }
