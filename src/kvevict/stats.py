"""The per-key statistics attention collects for the policies, each declared and computed once.

A policy names what it reads (``Policy.stats``); attention computes those columns over the keys
it attends (``kvevict.attention``: each statistic below adds its part of every chunk of scored
queries, from p, each query's probabilities summed over the query heads of a KV group, or from
the keys themselves); each tier keeps one value per slot and folds every step's column into it
(``Tier.accumulate``) as the statistic's ``fold`` says:

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
needs: what its column is computed from (``NEEDS``); from_pg follows: False for key norms (taken
when a key is written) and expected attention (from the queries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

FP16_MAX = torch.finfo(torch.float16).max

# What a statistic's column can be computed from: "pg", a chunk's probabilities summed over each
# KV group (b, hkv, c, n); "seen", which query of the chunk saw which key; "probs", the chunk's
# probabilities per query head (b, hkv, g, c, n); "queries"; "keys".
NEEDS = frozenset({"pg", "seen", "probs", "queries", "keys"})


@dataclass(frozen=True)
class Stat:
    """A statistic: its declaration (the fields) and its computation (the methods, which a
    subclass overrides). Attention starts a column per statistic, lets every chunk of scored
    queries add to it, then finishes it: (b, hkv, n_past + q) float32 (``blocks``: per block)."""

    name: str
    accumulates: str
    dtype: torch.dtype
    fold: str = "add"
    fused: bool = True
    needs: frozenset = frozenset({"pg"})
    # alone, the statistic is each chunk's probabilities summed over heads and queries: one
    # reduction, and no pg built (H2O's decode step)
    one_pass: ClassVar[bool] = False

    @property
    def from_pg(self) -> bool:
        return bool(self.needs & {"pg", "probs"})

    def scored(self, observe: int) -> int | None:
        """How many of a first prompt's last queries attention must score for it (None: all)."""
        return None

    def start(self, f: Collection) -> torch.Tensor | None:
        """The column before the first chunk; None: zero until a chunk adds to it."""
        return None

    def add(self, col: torch.Tensor | None, ch: Chunk) -> torch.Tensor | None:
        """The column with chunk ``ch``'s part added (in place where it was started)."""
        return col

    def finish(self, col: torch.Tensor | None, f: Collection) -> torch.Tensor:
        return f.zeros() if col is None else col


class Sum(Stat):
    one_pass = True

    def add(self, col, ch):
        return ch.into(col, ch.query_sum())


class Sq(Stat):
    def add(self, col, ch):
        return ch.into(col, ch.pg.square().sum(2))


class Last(Stat):
    def scored(self, observe):
        return 1

    def add(self, col, ch):
        return ch.last_row if ch.e == ch.f.q else col

    def finish(self, col, f):
        return super().finish(col, f).contiguous()  # a chunk's row: a copy of it (one query: itself)


class Obs(Stat):
    def scored(self, observe):
        return observe

    def add(self, col, ch):
        first = ch.f.q - ch.f.observe  # the first observed query
        return col if ch.e <= first else ch.into(col, ch.query_sum(max(ch.s, first) - ch.s))


class Hits(Stat):
    def add(self, col, ch):
        return ch.into(col, ch.hit.sum(2))


class HitsEma(Stat):
    def add(self, col, ch):  # weight gamma^(age of the query at the end of this forward)
        q, s, e = ch.f.q, ch.s, ch.e
        w = ch.f.gamma ** torch.arange(q - 1 - s, q - 1 - e, -1, device=ch.pg.device, dtype=torch.float32)
        return ch.into(col, (ch.hit * w.view(1, 1, -1, 1)).sum(2))


class Knorm(Stat):
    def scored(self, observe):
        return 0

    def start(self, f):  # written once: zero for stored keys, so the cache's running sum keeps it
        col = f.zeros()
        seg = f.seg
        col[..., f.n_past :] = seg.knorm_new if seg.knorm_new is not None else seg.k_new.float().norm(dim=-1)
        return col


class Max(Stat):
    def scored(self, observe):
        return observe

    def start(self, f):
        return f.zeros()

    def add(self, col, ch):
        first = ch.f.q - ch.f.observe
        if ch.e > first:
            m = ch.probs[:, :, :, max(ch.s, first) - ch.s :].amax(dim=(2, 3))
            torch.maximum(col[..., : m.shape[-1]], m, out=col[..., : m.shape[-1]])
        return col


class Expected(Stat):
    def scored(self, observe):
        return 0  # the queries give it, not their scores

    def finish(self, col, f):
        return expected_attention(f.qs, f.seg, f.observe or f.q)


class Blocks(Stat):
    def start(self, f):
        n_blocks = int(f.seg.pos_new.max()) // f.block + 1
        return torch.zeros(f.b, f.hkv, n_blocks, f.n_all, dtype=torch.float32, device=f.dev)

    def add(self, col, ch):
        pg, pos = ch.pg, ch.f.seg.pos_new
        bi = (pos[:, ch.s : ch.e] // ch.f.block).view(pos.shape[0], 1, ch.e - ch.s, 1).expand_as(pg)
        col[..., : pg.shape[-1]].scatter_add_(2, bi, pg)
        return col


STATS: dict[str, Stat] = {
    s.name: s
    for s in (
        Sum("sum", "sum_t p_t(i): the attention key i received (H2O, MAS, RoCo)", torch.float16),
        Sq("sq", "sum_t p_t(i)^2 (RoCo's standard deviation)", torch.float32),
        Last("last", "p_T(i): the newest query's attention (TOVA)", torch.float16, fold="set"),
        Obs("obs", "sum over the last `observe` queries of p_t(i) (SnapKV's window)", torch.float16),
        Hits(
            "hits",
            "count of queries with p_t(i) >= G / n_t, above uniform (A2SF / AQAS)",
            torch.float32,
            needs=frozenset({"pg", "seen"}),
        ),
        HitsEma(
            "hits_ema",
            "the hits, each weighted gamma^(its age) (Scissorhands' history)",
            torch.float32,
            fold="decay",
            needs=frozenset({"pg", "seen"}),
        ),
        Knorm(
            "knorm",
            "||k_i||, the key's norm as the model made it (knorm)",
            torch.float16,
            needs=frozenset({"keys"}),
        ),
        Max(
            "max",
            "max over heads and the last `observe` queries of p_t(i) (KVzip's reconstruction)",
            torch.float16,
            fused=False,
            needs=frozenset({"probs"}),
        ),
        Expected(
            "expected",
            "the attention a Gaussian fit of the recent queries expects (expected attention)",
            torch.float32,
            fused=False,
            needs=frozenset({"queries", "keys"}),
        ),
        Blocks(
            "blocks",
            "sum_t p_t(i) per block of query positions (the oracle's record of the future)",
            torch.float32,
            fused=False,
        ),
    )
}
assert all(s.needs <= NEEDS for s in STATS.values())

FUSED_CANNOT = frozenset(n for n, s in STATS.items() if not s.fused)
NOT_FROM_PG = frozenset(n for n, s in STATS.items() if not s.from_pg)


def stat(name: str) -> Stat:
    if name not in STATS:
        raise ValueError(
            f"unknown statistic {name!r}; kvevict.stats declares {', '.join(STATS)} "
            "(a new one is declared there, with its computation)."
        )
    return STATS[name]


def stat_dtype(name: str) -> torch.dtype:
    return stat(name).dtype


def stat_bytes(stats) -> int:
    """Bytes a slot gives the statistics ``stats`` (names), per (sequence, KV head)."""
    return sum(stat_dtype(n).itemsize for n in stats)


class Collection:
    """The statistics ``wanted`` of one attention call over n_all = n_past + q keys: their
    columns, started, added to by every chunk of scored queries, then finished.

    seg: the call's ``kvevict.attention._Segments``; qs: the scaled queries (b, hkv, g, q, d)
    (None in the fused path, which collects no statistic that reads them)."""

    def __init__(self, wanted, seg, qs, b, g, q, n_past, observe=0, gamma=1.0, block=0):
        self.stats = [stat(n) for n in dict.fromkeys(wanted)]
        self.needs = frozenset().union(*(s.needs for s in self.stats))
        self.one_pass = len(self.stats) == 1 and self.stats[0].one_pass
        self.seg, self.qs, self.b, self.hkv, self.g, self.q = seg, qs, b, seg.k_new.shape[1], g, q
        self.n_past, self.n_all, self.dev = n_past, n_past + q, seg.k_new.device
        self.observe, self.gamma, self.block = observe, gamma, block
        self.cols = {s.name: s.start(self) for s in self.stats}

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.b, self.hkv, self.n_all, dtype=torch.float32, device=self.dev)

    def add(self, ch: Chunk) -> None:
        for s in self.stats:
            self.cols[s.name] = s.add(self.cols[s.name], ch)

    def finish(self) -> dict[str, torch.Tensor]:
        return {s.name: s.finish(self.cols[s.name], self) for s in self.stats}


class Chunk:
    """Queries [s, e) of the call, as attention scored them over the n = n_past + e keys they see
    (the kept keys: no summary column), and what the statistics read of them, each computed at
    most once. ``probs``: (b, hkv, g, c, n) per query head; the fused path has none and gives
    ``row`` instead, its one query's probabilities summed over the group (b, hkv, n).
    ``seen``: (b|1, hkv|1, c, n) bool, which query saw which key, given when a statistic needs it."""

    def __init__(self, f: Collection, s: int, e: int, probs=None, row=None, seen=None):
        self.f, self.s, self.e, self.probs, self.row, self.seen = f, s, e, probs, row, seen
        # computed at most once, when first read (a plain attribute: functools.cached_property
        # takes a lock, which torch.compile cannot trace)
        self._pg: torch.Tensor | None = None
        self._hit: torch.Tensor | None = None

    @property
    def pg(self) -> torch.Tensor:
        """(b, hkv, c, n): the probabilities summed over the query heads of each KV group."""
        if self._pg is None:
            self._pg = self.row.unsqueeze(2) if self.row is not None else self.probs.sum(2, dtype=torch.float32)
        return self._pg

    @property
    def last_row(self) -> torch.Tensor:
        return self.row if self.row is not None else self.pg[:, :, -1]

    def query_sum(self, lo: int = 0) -> torch.Tensor:
        """pg summed over the chunk's queries from the ``lo``-th on: (b, hkv, n)."""
        if self.row is not None:  # one query: its row, bit for bit
            return self.row
        if self.f.one_pass:  # no pg built
            return self.probs.sum(dim=(2, 3), dtype=torch.float32)
        return (self.pg[:, :, lo:] if lo else self.pg).sum(2)

    @property
    def hit(self) -> torch.Tensor:
        """(b, hkv, c, n) float32: 1 where a_t(i) >= G / n_t, above uniform (n_t = keys query t
        sees); 0 for a padding query."""
        if self._hit is None:
            self._hit = self._hits()
        return self._hit

    def _hits(self) -> torch.Tensor:
        n_vis = self.seen.sum(-1, keepdim=True)
        hit = (self.pg * n_vis >= self.f.g).to(torch.float32)
        valid_new = self.f.seg.valid_new
        return hit if valid_new is None else hit * valid_new[:, None, self.s : self.e, None]

    def into(self, col: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """col[..., :n] += x, col starting at zero: a first part over every key is the column."""
        if col is None:
            if x.shape[-1] == self.f.n_all:
                return x
            col = self.f.zeros()
        col[..., : x.shape[-1]] += x
        return col


def expected_attention(qs, seg, w: int) -> torch.Tensor:
    """(b, hkv, n_past + q): the attention a Gaussian query N(mu, diag(var)) fitted to the last
    ``w`` (scaled) queries of each head is expected to give every key, E[exp(q.k)] =
    exp(mu.k + k^T diag(var) k / 2), normalised over the keys, summed over the group's heads and
    weighted by the number of real queries of this forward (decode: one query, var = 0: its
    attention exactly)."""
    b, hkv, g, q, d = qs.shape
    last = qs[:, :, :, q - min(w, q) :].float()
    if seg.valid_new is not None:
        last = last[:, :, :, -1:]  # padded batches: the last query is real in every row
    mu, var = last.mean(3), last.var(3, unbiased=False)  # (b, hkv, g, d)
    z = torch.cat(
        [_expected_logits(mu, var, p.keys()) for p in seg.pieces] + [_expected_logits(mu, var, seg.k_new)], dim=-1
    )  # (b, hkv, g, n): piece by piece
    if seg.valid_past is not None or seg.valid_new is not None:
        n_past = z.shape[-1] - q
        vp = (
            seg.valid_past
            if seg.valid_past is not None
            else torch.ones(1, 1, n_past, dtype=torch.bool, device=qs.device)
        )
        vn = (
            seg.valid_new[:, None]
            if seg.valid_new is not None
            else torch.ones(1, 1, q, dtype=torch.bool, device=qs.device)
        )
        valid = torch.cat([vp.expand(b, hkv, -1), vn.expand(b, hkv, -1)], -1)
        z = z.masked_fill(~valid[:, :, None], float("-inf"))
    m = q if seg.valid_new is None else seg.valid_new.sum(1).view(b, 1, 1).float()
    return torch.softmax(z, dim=-1).sum(2) * m


def _expected_logits(mu, var, keys):
    """mu . k + k^T diag(var) k / 2 for every key of one piece: (b, hkv, g, n)."""
    k = keys.float()
    return mu @ k.transpose(-1, -2) + 0.5 * (var @ k.square().transpose(-1, -2))
