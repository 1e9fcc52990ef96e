"""Forks of a compressed context: caches that read one filled ``EvictingCache`` (batch 1, never
written again) and keep the tokens appended after it (a question, then its answer) whole, in the
model's dtype, in a tail of their own.

Attention over a fork reads the parent's stored slots as they are (packed codes included) followed
by the fork's tail: the same chunked softmax over pieces ``kvevict.attention.attend`` runs for any
cache, each piece of the parent read with batch 1 and broadcast to the fork's rows (no copy of the
parent). A decode step reads the parent's runs with the fused kernels, expanded to the fork's rows
without a copy (stride 0), where the kernel takes strides (CPU); on other devices a fork of more than
one row reads the pieces (``attend``'s torch path). Positions go on from every token the context saw,
kept or evicted (as ``EvictingLayer.get_seq_length``), so RoPE places the question where it would
follow the whole context.

Memory: a fork's ``kv_bytes`` counts only what it holds itself (its tail: keys, values, positions,
validity). The compressed part is shared by every fork of it and counted once, by the parent's own
``kv_bytes`` (``ForkCache.shared_kv_bytes``): k forks of one context hold
``parent.kv_bytes() + sum(fork.kv_bytes())``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import PaddingInfo, _Segments, hand_off
from .headpool import cat_slots
from .input_checks import no_new_tokens
from .kernels.runs import Run
from .layer import EvictingLayer
from .stock import STOCK_BYTES
from .storage.interface import Piece

_GROW = 32  # tail slots are added this many at a time at least (then doubling), not one per step


@dataclass
class ParentView:
    """What a fork reads of one parent layer, fixed once (the parent is never written again):
    its stored slots' runs, validity and positions, its evicted mean, its key basis."""

    layer: EvictingLayer  # the parent layer
    n: int  # stored slots attention reads (tiers and recent tiers)
    valid: torch.Tensor | None  # (1, h|1, n) bool, None: every slot holds a token visible to every head
    pos: torch.Tensor | None  # (1, h|1, n) long, for sliding windows only
    runs: list  # of kernels.Run, as stored (batch 1)
    summary: tuple | None  # merge.Summary.term: the evicted tokens' mean slot, or None

    def pieces(self) -> list[Piece]:
        """The stored slots as attention's torch path reads them (made per forward: a paged store
        lays its pages out for the forward that reads them only)."""
        parts = self.layer._parts()
        return [p for t in parts for p in t.store.pieces(t.filled)]


def parent_view(layer: EvictingLayer) -> ParentView:
    """A filled ``EvictingLayer``'s ``ParentView`` (one host read: whether any slot is masked)."""
    if layer.compact is not None:
        raise ValueError(
            "a compressed context cannot be forked with compact positions (its keys are re-rotated to "
            "new positions every step): compress without compact=True."
        )
    parts = layer._parts()
    n = sum(t.filled for t in parts)
    valid: torch.Tensor | None = cat_slots([t.valid[:, :, : t.filled] for t in parts])
    if layer.pool is not None:  # Ada-KV: one row of slots for every head, each head sees its own
        valid = layer.pool.visible(parts, valid, True)
    if valid is not None and bool(valid.all()):
        valid = None
    pos = cat_slots([t.pos[:, :, : t.filled] for t in parts]).long() if layer.window is not None else None
    runs = [t.store.run(t.filled) for t in parts]
    summary = None if layer.summary is None else layer.summary.term(layer.dtype)
    for t in layer.tiers:  # paged bookkeeping laid out by these reads: none is held (as absorb does)
        t.drop_views()
    return ParentView(layer, n, valid, pos, runs, summary)


class Tail:
    """A fork layer's own tokens, every one kept: keys, values (b, h, capacity, d) in the model's
    dtype, each slot's validity (padding: False) and position (b, capacity), filled to ``filled``.
    ``limit``: the most slots the tail will take (a question and its longest answer), where the
    caller knows it: growth stops there, so the slots held are never more than those asked for."""

    def __init__(self, batch: int, device, limit: int | None = None) -> None:
        self.limit = limit
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.filled = 0
        self.n_real = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens per row

    def append(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, pos: torch.Tensor) -> None:
        m, end = k.shape[2], self.filled + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            cap = max(end, 2 * self.filled, _GROW)
            if self.limit is not None and end <= self.limit:
                cap = min(cap, self.limit)  # never past what the caller said a row appends
            self._grow(k, v, cap)
        assert self.k is not None and self.v is not None
        self.k[:, :, self.filled : end] = k
        self.v[:, :, self.filled : end] = v
        real = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
        self.valid[:, self.filled : end] = real
        self.pos[:, self.filled : end] = pos.masked_fill(~real, -1)
        self.n_real += m if valid is None else valid.sum(1)
        self.filled = end

    def _grow(self, k, v, cap: int) -> None:
        b, h = k.shape[:2]
        new_k = k.new_zeros(b, h, cap, k.shape[-1])
        new_v = v.new_zeros(b, h, cap, v.shape[-1])
        valid = self.valid.new_zeros(b, cap)
        pos = self.pos.new_full((b, cap), -1)
        if self.k is not None and self.v is not None:
            new_k[:, :, : self.filled], new_v[:, :, : self.filled] = (
                self.k[:, :, : self.filled],
                self.v[:, :, : self.filled],
            )
        valid[:, : self.filled], pos[:, : self.filled] = self.valid[:, : self.filled], self.pos[:, : self.filled]
        self.k, self.v, self.valid, self.pos = new_k, new_v, valid, pos

    def pieces(self) -> list[Piece]:
        if not self.filled or self.k is None or self.v is None:
            return []
        k, v = self.k[:, :, : self.filled], self.v[:, :, : self.filled]
        return [Piece(self.filled, lambda: k, lambda: v)]

    def run(self) -> Run:
        assert self.k is not None and self.v is not None
        return Run(32, 0, (self.k[:, :, : self.filled],), (self.v[:, :, : self.filled],), self.filled)

    def nbytes(self) -> int:
        held = [t for t in (self.k, self.v) if t is not None] + [self.valid, self.pos, self.n_real]
        return sum(t.nbytes for t in held)


def _expand_run(run: Run, b: int) -> Run:
    """A batch-1 run read by ``b`` rows without a copy: stride 0 over the rows (paged: the table)."""
    if b == 1:
        return run
    if run.table is not None:
        return Run(run.bits, run.group, run.k, run.v, run.n, run.table.expand(b, -1), run.page)
    grow = lambda t: t.expand(b, *t.shape[1:])  # noqa: E731
    return Run(run.bits, run.group, tuple(map(grow, run.k)), tuple(map(grow, run.v)), run.n)


class ForkLayer(CacheLayerMixin):
    """One decoder layer of a fork: the parent layer's slots, read only, then its own ``Tail``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, view: ParentView, batch: int, limit: int | None = None) -> None:
        super().__init__()
        self.view, self.batch = view, batch
        self.parent = view.layer
        self.tail = Tail(batch, self.parent.device, limit)
        self.new: tuple | None = None  # this forward's keys and values, from update to absorb
        self.returned_keys = None  # what update handed the model (attention checks it is the same)
        self.position_check = None  # a decode step's deferred positions check (kvevict.input_checks)
        self._padded = False  # whether any tail slot holds padding
        self.is_initialized = True
        self.keys = self.values = None

    layer_idx = property(lambda self: self.parent.layer_idx)
    dtype = property(lambda self: self.parent.dtype)
    device = property(lambda self: self.parent.device)
    window = property(lambda self: self.parent.window)

    @property
    def seen(self) -> int:
        """Positions so far: every token the context saw, then this fork's (padding included)."""
        return self.parent.seen + self.tail.filled

    def lazy_initialization(self, key_states, value_states) -> None:  # the parent fixed everything
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != self.batch:
            raise ValueError(
                f"this fork was made for {self.batch} rows and got {key_states.shape[0]}; "
                f"fork the context again with batch={key_states.shape[0]}."
            )
        self.new = (key_states, value_states)
        h, dk, dv = self.parent.dims
        n = self.view.n + self.tail.filled
        zero = torch.zeros((), dtype=key_states.dtype, device=key_states.device)
        keys, values = zero.expand(self.batch, h, n, dk), zero.expand(self.batch, h, n, dv)
        self.returned_keys = keys  # shape-only stand-ins: attention reads the pieces itself
        hand_off(self)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def attention_request(self) -> tuple[tuple, dict]:
        return (), {}  # a fork evicts nothing: no statistic to collect

    def segments(self, value_view, info: PaddingInfo | None, q_len: int, query=None) -> _Segments:
        """The parent's slots, then the tail's, then the new tokens (see the module doc)."""
        assert self.new is not None, "update() hands the new keys over before attention reads the segments"
        k_new, v_new = self.new
        b = k_new.shape[0]
        valid_new = None
        if info is not None and info.padding is not None:
            valid_new = info.real_upto(self.seen + q_len)[:, self.seen :]
            self._padded = True
        space = self.parent.keyspace  # the parent stores keys rotated: the new keys and queries join them
        if space is not None:  # its centre is set (the parent is filled): entering rotates only
            if query is None:
                k_new = space.enter(k_new, valid_new)
            else:
                k_new, query = space.enter_with_query(k_new, query, valid_new)
            self.new = (k_new, v_new)
        base = (self.parent.n_real + self.tail.n_real)[:, None]
        steps = torch.arange(q_len, device=k_new.device) if valid_new is None else valid_new.long().cumsum(1) - 1
        runs = None
        if q_len == 1 and (b == 1 or k_new.device.type == "cpu"):  # stride-0 rows: kernels that take strides
            runs = [_expand_run(r, b) for r in self.view.runs] + ([self.tail.run()] if self.tail.filled else [])
        summary = self.view.summary
        if summary is not None:
            summary = tuple(t.expand(b, *t.shape[1:]) for t in summary)
        return _Segments(
            pieces=self.view.pieces() + self.tail.pieces(),
            pos_past=self._past(self.view.pos, self.tail.pos, b) if self.window is not None else None,
            valid_past=self._past(self.view.valid, self.tail.valid if self._padded else None, b),
            k_new=k_new,
            v_new=v_new,
            pos_new=base + steps,
            valid_new=valid_new,
            runs=runs,
            summary=summary,
            query=query if space is not None else None,
        )

    def _past(self, parent: torch.Tensor | None, tail: torch.Tensor | None, b: int):
        """The parent's per-slot tensor (1, h|1, n) then the tail's (b, t), as (b, h|1, n + t); None
        when neither is given (nothing to mask)."""
        if parent is None and tail is None:
            return None
        t = self.tail.filled
        if parent is None:  # validity only (positions are always given): every slot visible
            parent = torch.ones(1, 1, self.view.n, dtype=torch.bool, device=self.device)
        if tail is None:
            tail = torch.ones(1, t, dtype=torch.bool, device=self.device)
        tail = tail[:, None, :t]
        h = max(parent.shape[1], tail.shape[1])
        return torch.cat([parent.expand(b, h, -1), tail.expand(b, h, -1)], dim=-1)

    def absorb(self, stats: dict, valid_new, pos_new) -> None:
        """Keep the new tokens whole in the tail (nothing is evicted, the parent is not written)."""
        assert self.new is not None, "absorb() follows update() and segments()"
        k_new, v_new = self.new
        self.new = None
        self.tail.append(k_new, v_new, valid_new, pos_new)

    def kv_bytes(self) -> int:
        return self.tail.nbytes()

    def reset(self) -> None:
        """Forget the tail: the fork reads the bare context again."""
        self.tail = Tail(self.batch, self.device, self.tail.limit)
        self.new = self.returned_keys = self.position_check = None
        self._padded = False


class ForkCache(Cache):
    """A cheap cache over a compressed context (``kvevict.compress``): ``batch`` rows that each go on
    from the whole context. Pass it to ``model(...)`` or ``model.generate(..., cache=fork)`` with the
    context's ids followed by the new tokens (generate feeds the tokens past the context's length).
    See the module doc for what it reads and what its ``kv_bytes`` counts. ``limit``: the most
    tokens a row will append (its question and the most new tokens), where known: each layer's tail
    stops growing there instead of doubling past it (``Tail``)."""

    def __init__(self, parent, batch: int = 1, views: list | None = None, limit: int | None = None) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"a fork has batch >= 1 rows (one per question), got batch={batch!r}.")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"a fork's limit is the tokens a row appends, an int >= 1 (or None), got {limit!r}.")
        layers = getattr(parent, "layers", None)
        if not layers or not all(getattr(x, "is_initialized", False) and hasattr(x, "tiers") for x in layers):
            raise ValueError(
                "a fork reads a filled EvictingCache: compress a context first (kvevict.compress), "
                "or fill a make_cache(...) cache with one forward of the context."
            )
        if layers[0].n_real.shape[0] != 1:
            raise ValueError(
                f"a fork reads a context of one row; this cache holds {layers[0].n_real.shape[0]}: compress "
                "each context alone and fork it once per batch of questions."
            )
        views = views if views is not None else [parent_view(x) for x in layers]
        super().__init__(layers=[ForkLayer(v, batch, limit) for v in views])
        self.parent, self.batch = parent, batch

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if query_length == 0:
            raise ValueError(no_new_tokens(self.get_seq_length()))
        return super().get_mask_sizes(query_length, layer_idx)

    @property
    def context_length(self) -> int:
        """Tokens the compressed context saw (its positions; the appended tokens start here)."""
        return self.parent.layers[0].seen

    def kv_bytes(self) -> int:
        """Bytes this fork holds itself: its tails (the appended tokens, whole). The compressed
        context it reads is shared and counted once by ``shared_kv_bytes``."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def shared_kv_bytes(self) -> int:
        """Bytes of the compressed context every fork of it reads (the parent's ``kv_bytes``)."""
        return self.parent.kv_bytes()

    def full_kv_bytes(self, dtype_bytes: int | None = STOCK_BYTES) -> int:
        """Bytes a stock transformers cache would hold for these rows: each row the whole context
        and its own tokens (padding included), a sliding layer its last window - 1 (``kvevict.stock``)."""
        total = 0
        for layer in self.layers:
            h, dk, dv = layer.parent.dims
            kept = layer.seen if layer.window is None else min(layer.seen, layer.window - 1)
            total += self.batch * h * kept * (dk + dv) * (dtype_bytes or layer.dtype.itemsize)
        return total
