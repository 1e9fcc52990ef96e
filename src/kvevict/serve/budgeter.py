"""How many bytes a request's cache may hold, for admission: a request is admitted when the bytes
of every running batch, with it added, stay within ``Settings.kv_memory``; otherwise it waits.

Budgeted rows of any policies and budgets share one ``EvictingCache``. Storage grows in pages
(``storage.PAGE`` slots) as a sequence does, never past its budget. In the server each row's keys and
values, and each slot's position and every policy's statistics beside them, are its own pages of
one pool (``kvevict.storage.paged``): a row holds ``ceil(min(tokens, budget) / PAGE)`` pages per layer
and per-slot tensor, whatever the other rows of its batch hold. What stays batch-wide is a page
table per tensor (8 bytes per page column): as wide as ``page_slots(longest row, widest budget)``.

Bytes are measured, not derived from a formula: at start-up one token runs through the model into
a ``DynamicCache`` (a full-cache token's K + V bytes), and two budgeted caches per policy are
filled to their budgets (their ``kv_bytes`` at two budgets give each layer's bytes per slot, keys
and values plus the policy's per-slot state, and its bytes per sequence besides), for this model,
dtype and storage (``kv_bits``: packed codes with their steps and zeros, the server's
``--kv-bits``). A slot's position is 2 bytes (int16) while every row of a cache fits them, 4 once
one passes 32,767 (``Tier.widen_positions``; back to 2 when it leaves): the probes, widened, give
what that adds per slot, counted for every row of a batch whose length (prompt + max_tokens) may
pass (``wide``).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from ..budget import layer_budgets
from ..cache import make_cache
from ..policies import POLICIES, make_policy
from ..rows import stat_names
from ..shape import layer_windows
from ..stats import stat_bytes
from ..stock import STOCK_BYTES
from ..storage import PAGE, page_slots
from ..storage.layout import POS16_MAX, SlotLayout

PROBES = (64, 128)  # budgets of the two probe caches


@functools.lru_cache(maxsize=None)
def spec_policy(name: str, recent: int | None):
    """The policy a request's ``kv_policy`` and recent window name, made once per pair: admission
    and the gauges ask for it on every worker loop, and it is only read (statistics, budgets)."""
    return make_policy(name, **({} if recent is None else {"recent": recent}))


def wide(length: int) -> bool:
    """Whether a row of ``length`` tokens may hold a position past int16 (its last is length - 1):
    then its cache's positions are int32, and so are those of every row of its batch."""
    return length - 1 > POS16_MAX


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
        self.heads = next(layer.keys.shape[1] for layer in full.layers if layer.is_initialized)  # KV heads
        # the denominator of usage's kv_bytes_full: a stock cache in 16 bits, sliding layers at their window
        self.stock_per_layer = [n * STOCK_BYTES // model.dtype.itemsize for n in self.per_layer]
        self.slots_of = {}  # policy -> per layer (bytes per slot, bytes per sequence besides)
        self.wide_of = {}  # policy -> per layer, the bytes per slot int32 positions add (``wide`` rows)
        for name in POLICIES:
            try:
                small, big = (self._probe(make_cache(model, name, b, kv_bits=kv_bits, slack=1), b) for b in PROBES)
            except (ValueError, TypeError):  # a policy that cannot serve (the oracle needs a recording)
                continue
            self.slots_of[name] = [_line(a, b) for a, b in zip(small.layers, big.layers)]
            for probe in (small, big):
                for layer in probe.layers:
                    for tier in layer.tiers:
                        tier.widen_positions(POS16_MAX + 1)
            self.wide_of[name] = [
                _line(a, b)[0] - narrow for a, b, (narrow, _) in zip(small.layers, big.layers, self.slots_of[name])
            ]
        # per layer: bytes of a slot with no statistic (recency keeps none), per byte of statistic
        # a slot of one KV head holds (H2O keeps "sum", ``stat_bytes``), and per row besides; a
        # shared batch's slot carries the union's
        self.slot_parts = [
            (bare, (one - bare) // stat_bytes(POLICIES["h2o"].stats), rest)
            for (bare, rest), (one, _) in zip(self.slots_of["recency"], self.slots_of["h2o"])
        ]
        # a running batch's bound changes only when its rows do; the gauges ask every step
        self._batch_bytes = functools.lru_cache(maxsize=1024)(self._bytes_of)

    def _probe(self, cache, tokens: int = 1):
        """``tokens`` through the model into ``cache`` (a budgeted one is filled to its budget)."""
        with torch.inference_mode():
            self.model(torch.zeros(1, tokens, dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def stock_bytes(self, tokens: int) -> int:
        """What a stock cache holds for ``tokens`` tokens of one sequence in 16 bits (``kvevict.stock``)."""
        return sum(n * (tokens if w is None else min(tokens, w)) for n, w in zip(self.stock_per_layer, self.windows))

    def slots(self, policy, budget_tokens: int, length: int) -> list[int]:
        """Slots per layer and KV head a row of ``length`` tokens holds: whole pages, never past its
        per-layer budget (PyramidKV: a schedule), nor past a sliding layer's window."""
        budgets = layer_budgets(policy, budget_tokens, len(self.per_layer))
        return [page_slots(length, b if w is None else min(b, w)) for b, w in zip(budgets, self.windows)]

    def row_bytes(self, policy: str, budget_tokens: int | None, recent: int | None, length: int) -> int:
        """The most bytes one sequence's cache holds: a full cache grows to ``length`` (prompt +
        max_tokens); a budgeted one to ``slots`` per layer (int32 positions past 32,767: ``wide``)."""
        if policy == "full":
            return length * self.token_bytes
        widths = self.slots(spec_policy(policy, recent), budget_tokens, length)
        more = self.wide_of[policy] if wide(length) else [0] * len(widths)
        return sum((per_slot + x) * w + rest for w, x, (per_slot, rest) in zip(widths, more, self.slots_of[policy]))

    def fits(self, policy, budget_tokens: int, length: int) -> bool:
        """Whether a prompt of ``length`` tokens enters every layer without evicting (its budget
        there, a sliding layer's window)."""
        budgets = layer_budgets(policy, budget_tokens, len(self.per_layer))
        return all(length <= (b if w is None else min(b, w)) for b, w in zip(budgets, self.windows))

    def shared(self, policy) -> int:
        """Slots a token takes per slot of one KV head: the KV heads in an Ada-KV pooled tier, else 1."""
        return self.heads if getattr(policy, "adaptive", False) and self.heads > 1 else 1

    def own_pages(self, policy, budget_tokens: int, length: int) -> list[int]:
        """Pages per layer and per-slot tensor one row of ``length`` tokens holds in a pool (``kvevict.storage.paged``):
        its first min(length, budget) slots per KV head (Ada-KV: x heads, one pooled slot each)."""
        return [-(-min(length, w) * self.shared(policy) // PAGE) for w in self.slots(policy, budget_tokens, length)]

    def per_token(self, policy: str) -> tuple[int, int]:
        """(bytes per token one sequence keeps, its bytes besides), every layer, under ``policy``."""
        if policy == "full":
            return self.token_bytes, 0
        a, b = (self.row_bytes(policy, n, None, n) for n in PROBES)  # full pages: PROBES are multiples of PAGE
        per = (b - a) // (PROBES[1] - PROBES[0])
        return per, a - per * PROBES[0]

    def format_key(self, policy: str, recent: int | None) -> tuple:
        """What decides which page pools a row of ``policy`` opens: its statistics and pooling (a
        full-cache row opens none)."""
        if policy == "full":
            return ("full",)
        pol = spec_policy(policy, recent)
        return tuple(stat_names([pol])), self.shared(pol)

    def opening(self, policy: str, recent: int | None, length: int = 0) -> dict:
        """The page pools a row of ``policy`` and ``length`` tokens opens, each the most its page 0
        holds, by key: its formats (``format_key``): one page of every per-slot tensor, per
        distinct layer format (layers alike share pools); for a ``wide`` row also the int32
        positions pool (one for every layer of its KV heads: an int32 position is twice the 2
        bytes widening adds to a slot)."""
        if policy == "full":
            return {}
        shared = self.shared(spec_policy(policy, recent))
        out = {
            self.format_key(policy, recent): sum(
                PAGE * per_slot // shared for per_slot in {per for per, _ in self.slots_of[policy]}
            )
        }
        if wide(length):
            out[("int32 positions", self.heads // shared)] = PAGE * 2 * max(self.wide_of[policy]) // shared
        return out

    def opening_bytes(self, policy: str, recent: int | None, length: int = 0) -> int:
        """The most the page pools a row of ``policy`` and ``length`` tokens opens hold before it
        takes a page (``opening``)."""
        return sum(self.opening(policy, recent, length).values())

    def batch_bytes(self, rows: list[tuple], paged: bool = False) -> int:
        """The most a batch of rows sharing one cache can hold; ``rows``: (policy, budget_tokens,
        recent, prompt + max_tokens) each. Full-cache rows are left-padded to the longest: rows x
        the longest. Budgeted rows share one EvictingCache: rows x (per layer, the pages of the
        longest row under the largest budget any row has there x the bytes of a slot carrying
        every row's policy statistics, + the bytes per row besides). ``paged`` (the server's caches,
        ``kvevict.storage.paged``): a row holds only its own pages (``own_pages``) of every per-slot tensor
        (K/V, positions, statistics), and each row a page table per tensor as wide as the widest.
        Positions are one tensor of the whole batch: int32 for every row when one row's length may
        pass 32,767 (``wide``)."""
        return self._batch_bytes(tuple(rows), paged)

    def _bytes_of(self, rows: tuple, paged: bool = False) -> int:
        if not rows:
            return 0
        if rows[0][0] == "full":
            return len(rows) * max(r[3] for r in rows) * self.token_bytes
        pols = [spec_policy(p, recent) for p, _, recent, _ in rows]
        longest = max(r[3] for r in rows)
        widths = [max(col) for col in zip(*(self.slots(pol, r[1], longest) for pol, r in zip(pols, rows)))]
        names = stat_names(pols)
        union = stat_bytes(names)
        shared = self.shared(pols[0])
        tables = SlotLayout(0, 0, stats=names, pooled=shared > 1, page=PAGE)  # paged: a table per per-slot tensor
        own = [self.own_pages(pol, r[1], r[3]) for pol, r in zip(pols, rows)] if paged else []
        widened = wide(longest)
        total = held = 0
        for i, (w, (bare, stat, rest)) in enumerate(zip(widths, self.slot_parts)):
            # what a policy's slot holds besides K/V, position, validity and statistics (Ada-KV: its head id)
            extra = max(self.slots_of[r[0]][i][0] - bare - stat_bytes(pol.stats) * stat for pol, r in zip(pols, rows))
            per_slot = bare + union * stat + extra
            if widened:  # int32 positions, for every row of the batch
                per_slot += max(self.wide_of[r[0]][i] for r in rows)
            if not paged:
                total += w * per_slot + rest
                continue
            # every per-slot tensor is each row's own pages (a page: PAGE slots of K/V, position, head
            # id and statistics); what stays batch-wide is a table per tensor, as wide as the widest row
            total += rest + tables.table_bytes(1, -(-w * shared // PAGE))
            held += sum(pages[i] for pages in own) * (PAGE * per_slot // shared)
        return len(rows) * total + held


def _line(small, big) -> tuple[int, int]:
    """One layer's (bytes per slot, bytes per sequence besides) from its probes at two budgets
    (slots per KV head: a pooled Ada-KV tier holds heads x budget in one row)."""

    def slots(layer):
        return layer.tiers[0].capacity // layer.shared

    per_slot = (big.kv_bytes() - small.kv_bytes()) // (slots(big) - slots(small))
    return per_slot, small.kv_bytes() - per_slot * slots(small)
