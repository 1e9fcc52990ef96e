"""How many bytes a request's cache may hold, for admission: a request is admitted when the bytes
of every running batch, with it added, stay within ``Settings.kv_memory``; otherwise it waits.

Budgeted rows of any policies and budgets share one ``EvictingCache``. Storage grows in pages
(``tier.PAGE`` slots) as a sequence does, never past its budget, so a row holds
``pages(tokens, budget)`` slots per layer and KV head. Rows of one batch share one rectangle: each
layer is as wide as ``pages(longest row, widest budget)``, and each slot carries the statistics of
every policy in the batch. So that a short chat never pays for a long prompt's width, rows join a
batch only when their page counts are in the same power-of-two bucket (``width_bucket``).

Bytes are measured, not derived from a formula: at start-up one token runs through the model into
a ``DynamicCache`` (a full-cache token's K + V bytes), and two budgeted caches per policy are
filled to their budgets (their ``kv_bytes`` at two budgets give each layer's bytes per slot, keys
and values plus the policy's per-slot state, and its bytes per sequence besides), for this model,
dtype and storage (``kv_bits``: packed codes with their steps and zeros, the server's
``--kv-bits``).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from ..cache import layer_budgets, layer_windows, make_cache
from ..policies import POLICIES, make_policy
from ..rows import stat_names
from ..stock import STOCK_BYTES
from ..storage import stat_bytes
from ..tier import PAGE, pages

PROBES = (64, 128)  # budgets of the two probe caches
SMALL = 4  # rows of at most this many pages per layer share a batch whatever their widths


@functools.lru_cache(maxsize=None)
def spec_policy(name: str, recent: int | None):
    """The policy a request's ``kv_policy`` and recent window name, made once per pair: admission
    and the gauges ask for it on every worker loop, and it is only read (statistics, budgets)."""
    return make_policy(name, **({} if recent is None else {"recent": recent}))


class Budgeter:
    """Bytes per request and per batch, from bytes measured through the model."""

    def __init__(self, model, kv_bits: int | None = None):
        self.model, self.kv_bits = model, kv_bits
        # a sliding layer keeps at most its window less one token, as the stock cache does
        self.windows = [None if w is None else w - 1 for w in layer_windows(model)]
        full = self._probe(DynamicCache(config=model.config))
        self.per_layer = [layer.keys.nbytes + layer.values.nbytes for layer in full.layers if layer.is_initialized]
        self.token_bytes = sum(self.per_layer)  # one token of one sequence in a full cache, every layer
        self.entries_per_token = sum(layer.keys.shape[1] for layer in full.layers if layer.is_initialized)
        # the denominator of usage's kv_bytes_full: a stock cache in 16 bits, sliding layers at their window
        self.stock_per_layer = [n * STOCK_BYTES // model.dtype.itemsize for n in self.per_layer]
        self.slots_of = {}  # policy -> per layer (bytes per slot, bytes per sequence besides)
        for name in POLICIES:
            try:
                small, big = (self._probe(make_cache(model, name, b, kv_bits=kv_bits), b) for b in PROBES)
            except (ValueError, TypeError):  # a policy that cannot serve (the oracle needs a recording)
                continue
            self.slots_of[name] = [_line(a, b) for a, b in zip(small.layers, big.layers)]
        # per layer: bytes of a slot with no statistic (recency keeps none), per byte of statistic
        # a slot of one KV head holds (H2O keeps "sum", ``stat_bytes``), and per row besides; a
        # shared batch's slot carries the union's
        self.slot_parts = [(bare, (one - bare) // stat_bytes(POLICIES["h2o"].stats), rest) for (bare, rest), (one, _)
                           in zip(self.slots_of["recency"], self.slots_of["h2o"])]
        # a running batch's bound changes only when its rows do; the gauges ask every step
        self._batch_bytes = functools.lru_cache(maxsize=1024)(self._bytes_of)

    def _probe(self, cache, tokens: int = 1):
        """``tokens`` through the model into ``cache`` (a budgeted one is filled to its budget)."""
        with torch.inference_mode():
            self.model(torch.zeros(1, tokens, dtype=torch.long), cache=cache, use_cache=True,
                       logits_to_keep=1)
        return cache

    def stock_bytes(self, tokens: int) -> int:
        """What a stock cache holds for ``tokens`` tokens of one sequence in 16 bits (``kvevict.stock``)."""
        return sum(n * (tokens if w is None else min(tokens, w)) for n, w in zip(self.stock_per_layer, self.windows))

    def slots(self, policy, budget_tokens: int, length: int) -> list[int]:
        """Slots per layer and KV head a row of ``length`` tokens holds: whole pages, never past its
        per-layer budget (PyramidKV: a schedule), nor past a sliding layer's window."""
        budgets = layer_budgets(policy, budget_tokens, len(self.per_layer))
        return [pages(length, b if w is None else min(b, w)) for b, w in zip(budgets, self.windows)]

    def row_bytes(self, policy: str, budget_tokens: int | None, recent: int | None, length: int) -> int:
        """The most bytes one sequence's cache holds: a full cache grows to ``length`` (prompt +
        max_tokens); a budgeted one to ``slots`` per layer."""
        if policy == "full":
            return length * self.token_bytes
        widths = self.slots(spec_policy(policy, recent), budget_tokens, length)
        return sum(per_slot * w + rest for w, (per_slot, rest) in zip(widths, self.slots_of[policy]))

    def width_bucket(self, spec: tuple) -> int:
        """Rows whose widest layer holds pages in the same power-of-two range share a batch, and
        rows of up to ``SMALL`` pages all share one: a short chat is never laid out as wide as a
        long prompt (it pays at most twice its own pages, or ``SMALL`` pages)."""
        policy, budget, recent, length = spec
        if policy == "full":
            return 0
        widest = max(self.slots(spec_policy(policy, recent), budget, length))
        return max(0, (max(1, -(-widest // PAGE)) - 1).bit_length() - SMALL.bit_length() + 1)

    def per_token(self, policy: str) -> tuple[int, int]:
        """(bytes per token one sequence keeps, its bytes besides), every layer, under ``policy``."""
        if policy == "full":
            return self.token_bytes, 0
        a, b = (self.row_bytes(policy, n, None, n) for n in PROBES)  # full pages: PROBES are multiples of PAGE
        per = (b - a) // (PROBES[1] - PROBES[0])
        return per, a - per * PROBES[0]

    def batch_bytes(self, rows: list[tuple]) -> int:
        """The most a batch of rows sharing one cache can hold; ``rows``: (policy, budget_tokens,
        recent, prompt + max_tokens) each. Full-cache rows are left-padded to the longest: rows x
        the longest. Budgeted rows share one EvictingCache: rows x (per layer, the pages of the
        longest row under the largest budget any row has there x the bytes of a slot carrying
        every row's policy statistics, + the bytes per row besides)."""
        return self._batch_bytes(tuple(rows))

    def _bytes_of(self, rows: tuple) -> int:
        if not rows:
            return 0
        if rows[0][0] == "full":
            return len(rows) * max(r[3] for r in rows) * self.token_bytes
        pols = [spec_policy(p, recent) for p, _, recent, _ in rows]
        longest = max(r[3] for r in rows)
        widths = [max(col) for col in zip(*(self.slots(pol, r[1], longest) for pol, r in zip(pols, rows)))]
        union = stat_bytes(stat_names(pols))
        total = 0
        for i, (w, (bare, stat, rest)) in enumerate(zip(widths, self.slot_parts)):
            # what a policy's slot holds besides K/V, position, validity and statistics (Ada-KV: its head id)
            extra = max(self.slots_of[r[0]][i][0] - bare - stat_bytes(pol.stats) * stat for pol, r in zip(pols, rows))
            total += w * (bare + union * stat + extra) + rest
        return len(rows) * total


def _line(small, big) -> tuple[int, int]:
    """One layer's (bytes per slot, bytes per sequence besides) from its probes at two budgets
    (slots per KV head: a pooled Ada-KV tier holds heads x budget in one row)."""
    def slots(layer):
        return layer.tiers[0].capacity // layer.shared

    per_slot = (big.kv_bytes() - small.kv_bytes()) // (slots(big) - slots(small))
    return per_slot, small.kv_bytes() - per_slot * slots(small)
