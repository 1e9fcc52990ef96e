"""The per-key statistics attention collects for the policies, declared once.

A policy names what it reads (``Policy.stats``); attention computes those columns over the keys
it attends (``kvevict.attention``: from p, each query's probabilities summed over the query heads
of a KV group, or from the keys themselves); each tier keeps one value per slot and folds every
step's column into it (``Tier.accumulate``) as the statistic's ``fold`` says:

- "add": s_i += x_i (sums over queries: H2O's a_i = sum_t p_t(i));
- "set": s_i = x_i (the newest query's value, TOVA);
- "decay": s_i = gamma^m s_i + x_i (an exponential history over the step's m queries).

dtype: what a slot stores. Statistics a policy only ranks by are float16 (a rank needs no more
than 11 bits; a sum saturates at ``FP16_MAX``, where a sink token stays first, after ~25K steps);
counters and squares stay float32 (float16 counts stop at 2,048 and squared probabilities
underflow). With them the int4 slot's bookkeeping falls to 12 of its 64 code bytes
(docs/results/quality-per-byte.md).
fused: whether the fused decode kernels' output gives it (``kvevict.kernels``): they return p
summed over the group, so per-head maxima, expected attention and per-block sums are not.
from_pg: computed from p; False for key norms (taken when a key is written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class Stat:
    name: str
    accumulates: str
    dtype: torch.dtype
    fold: str = "add"
    fused: bool = True
    from_pg: bool = True


STATS: dict[str, Stat] = {
    s.name: s
    for s in (
        Stat("sum", "sum_t p_t(i): the attention key i received (H2O, MAS, RoCo)", torch.float16),
        Stat("sq", "sum_t p_t(i)^2 (RoCo's standard deviation)", torch.float32),
        Stat("last", "p_T(i): the newest query's attention (TOVA)", torch.float16, fold="set"),
        Stat("obs", "sum over the last `observe` queries of p_t(i) (SnapKV's window)", torch.float16),
        Stat("hits", "count of queries with p_t(i) >= G / n_t, above uniform (A2SF / AQAS)", torch.float32),
        Stat(
            "hits_ema", "the hits, each weighted gamma^(its age) (Scissorhands' history)", torch.float32, fold="decay"
        ),
        Stat("knorm", "||k_i||, the key's norm as the model made it (knorm)", torch.float16, from_pg=False),
        Stat(
            "max",
            "max over heads and the last `observe` queries of p_t(i) (KVzip's reconstruction)",
            torch.float16,
            fused=False,
        ),
        Stat(
            "expected",
            "the attention a Gaussian fit of the recent queries expects (expected attention)",
            torch.float32,
            fused=False,
        ),
        Stat(
            "blocks",
            "sum_t p_t(i) per block of query positions (the oracle's record of the future)",
            torch.float32,
            fused=False,
        ),
    )
}

FUSED_CANNOT = frozenset(n for n, s in STATS.items() if not s.fused)
NOT_FROM_PG = frozenset(n for n, s in STATS.items() if not s.from_pg)


def stat(name: str) -> Stat:
    if name not in STATS:
        raise ValueError(
            f"unknown statistic {name!r}; kvevict.stats declares {', '.join(STATS)} "
            "(a new one is declared there, then computed in kvevict.attention)."
        )
    return STATS[name]


def stat_dtype(name: str) -> torch.dtype:
    return stat(name).dtype


def stat_bytes(stats) -> int:
    """Bytes a slot gives the statistics ``stats`` (names), per (sequence, KV head)."""
    return sum(stat_dtype(n).itemsize for n in stats)
