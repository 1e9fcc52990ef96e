"""Aggregation with 95% confidence intervals: Student t for means, Wilson for proportions."""

from __future__ import annotations

import math
from dataclasses import dataclass

# two-sided 97.5% quantiles of Student's t, df 1..30 (beyond that, the normal 1.96 is close enough)
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def t_quantile(df: int) -> float:
    if df < 1:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass
class Interval:
    mean: float
    lo: float
    hi: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        if self.n == 0:
            return "–"
        if self.n == 1 or math.isnan(self.lo):
            return f"{self.mean:.{digits}g} (n=1)"
        return f"{self.mean:.{digits}g} [{self.lo:.{digits}g}, {self.hi:.{digits}g}]"


def mean_ci(values) -> Interval:
    """mean ± t_{0.975, n-1} · s / sqrt(n)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    m = sum(xs) / n
    if n == 1:
        return Interval(m, float("nan"), float("nan"), 1)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def wilson_ci(successes: float, n: int, z: float = 1.96) -> Interval:
    """Wilson score interval for a proportion (well behaved at 0 and 1, unlike mean ± 2 se):
    (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # clamped: at p = 0 or 1 the bound is exactly 0 or 1, rounding can leave it a hair outside
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), n)


def aggregate(values, kind: str) -> Interval:
    """kind: 'mean' (t interval), 'proportion' (0/1 values, Wilson), 'exp' (the values are mean
    NLLs: the interval of their mean, exponentiated, i.e. perplexity)."""
    xs = list(values)
    if kind == "proportion":
        return wilson_ci(sum(xs), len(xs))
    ci = mean_ci(xs)
    if kind == "exp":
        return Interval(math.exp(ci.mean), math.exp(ci.lo), math.exp(ci.hi), ci.n) if ci.n else ci
    return ci
