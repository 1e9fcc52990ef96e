"""Per-row pages: a tier's keys and values in pages of ``PAGE`` slots taken from a pool that every
cache made with it shares, each row (sequence) holding only its own pages (vLLM's PagedAttention,
Kwon et al. 2023: a block table per sequence over one pool of blocks).

Without a pool a tier's storage is one rectangle per layer: every row of a shared batch as wide as
the widest. With one (``make_cache(..., pages=Pools())``; the server makes one per engine):

- ``PagePool``: the pages of one storage format (KV heads, widths and dtypes of the parts), each
  part one tensor (pages, h, PAGE, width). Page 0 is never handed out: a row's slots past its own
  pages read it (masked by attention), so a table needs no "none" entry. Freed pages are reused;
  the pool grows by a quarter at a time when none is free (one copy per growth).
- ``PagedStore``: a tier's store on a pool, with the tier's store interface (``write``, ``read``,
  ``pieces``, ``run``, ``map_batch``, ``nbytes``). Logical slot i of row r lives at
  (table[r, i // PAGE], i % PAGE). ``ensure`` gives each row the pages its fill needs, and no more;
  rows that leave (``map_batch`` with a selection) give theirs back at once; a store that is
  dropped gives back what it held (a finalizer); rows appended to another cache on the same pool
  move with their pages (no copy, ``disown``).

``nbytes`` counts the row's own pages and the table: what the stock cache would hold for the same
tokens, rounded up to a page per (layer, KV head). The pool's own size (``PagePool.nbytes``, free
pages included) is the server's to report.
"""

from __future__ import annotations

import weakref

import torch

from . import tier as _tier
from .kernels.runs import Run
from .store import DenseStore, PackedStore, Piece, _Packed, _spans, dequantize, quantize, trailing


class PagePool:
    """Pages of one storage format; ``parts``: (h, width, dtype) of each stored tensor. ``room``:
    () -> bytes the pool may still grow by before a growth takes only what is asked (None: no limit)."""

    def __init__(self, parts: list, device, page: int | None = None, room=None):
        self.page, self.room = page or _tier.PAGE, room
        self.tensors = [torch.zeros(1, h, self.page, w, dtype=dt, device=device) for h, w, dt in parts]
        self.free: list[int] = []

    @property
    def pages(self) -> int:
        return self.tensors[0].shape[0]

    def page_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def in_use(self) -> int:
        return self.pages - 1 - len(self.free)

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            self._grow(n - len(self.free))
        got, self.free = (self.free[-n:][::-1], self.free[:-n]) if n else ([], self.free)
        return got  # ascending ids: a row's consecutive pages lie forward in memory when they can

    def release(self, ids) -> None:
        self.free.extend(int(i) for i in ids if int(i) > 0)

    def _grow(self, n: int) -> None:
        extra = max(n, self.pages // 4)  # a quarter at a time: one copy of the pool per growth
        if self.room is not None:  # never past the limit for the slack alone
            extra = max(n, min(extra, self.room() // self.page_bytes()))
        old = self.pages
        self.tensors = [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in self.tensors]
        self.free = list(range(old + extra - 1, old - 1, -1)) + self.free  # lowest ids handed out first


class Pools:
    """One ``PagePool`` per storage format, made on first use: what caches sharing pages share.
    ``limit``: bytes the pools grow to for slack (the server's ``kv_memory``); what rows ask for is
    always given (admission keeps that within the limit)."""

    def __init__(self, page: int | None = None, limit: int | None = None):
        self.page, self.limit = page, limit
        self.pools: dict = {}

    def get(self, parts: list, device) -> PagePool:
        key = (tuple(parts), str(device))
        if key not in self.pools:
            room = None if self.limit is None else (lambda: max(0, self.limit - self.nbytes()))
            self.pools[key] = PagePool(parts, device, self.page, room)
        return self.pools[key]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pools.values())

    def pages_in_use(self) -> int:
        return sum(p.in_use() for p in self.pools.values())


def _release(pool: PagePool, held: list) -> None:
    """A dropped store's pages back to its pool (``held[0]``: its table, or None once disowned)."""
    if held[0] is not None:
        pool.release(held[0][held[0] > 0].tolist())
        held[0] = None


class PagedStore:
    """A tier's keys and values in pages of a shared pool (see the module doc)."""

    def __init__(self, pools: Pools, b, h, dk, dv, dtype, compute_dtype, device, bits=None, group: int = 32):
        self.bits, self.group, self.compute_dtype = bits, group, compute_dtype
        self.packed = bits in (8, 4, 2)
        if self.packed:
            k, v = _Packed(0, h, 0, dk, device, bits, group), _Packed(0, h, 0, dv, device, bits, group)
            parts = [(h, t.shape[-1], t.dtype) for part in (k, v) for t in part.tensors()]
        else:
            parts = [(h, dk, dtype), (h, dv, dtype)]
        self.pool = pools.get(parts, device)
        self.page, self.h = self.pool.page, h
        self.table = torch.zeros(b, 0, dtype=torch.long, device=device)
        self.own = [0] * b  # pages each row holds (on the host)
        self._held = [self.table]
        weakref.finalize(self, _release, self.pool, self._held)

    # -- pages ---------------------------------------------------------------------------------
    def ensure(self, fills: list[int]) -> None:
        """Give each row the pages its first ``fills[r]`` slots need (called before they are written)."""
        need = [-(-f // self.page) for f in fills]
        rows, cols = [], []
        for r, (n, o) in enumerate(zip(need, self.own)):
            if n > o:
                rows += [r] * (n - o)
                cols += range(o, n)
                self.own[r] = n
        if not rows:
            return
        if max(cols) >= self.table.shape[1]:
            self.resize((max(cols) + 1) * self.page)
        got = self.pool.alloc(len(rows))
        dev = self.table.device
        self.table[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(got, device=dev)

    def resize(self, n: int, fn=None) -> None:
        """The table covers ``n`` logical slots (new columns: page 0; cut columns hold no page)."""
        cols = -(-n // self.page)
        extra = cols - self.table.shape[1]
        if extra > 0:
            self.table = torch.cat([self.table, self.table.new_zeros(self.table.shape[0], extra)], dim=1)
        elif extra < 0:  # columns past every row's fill; a page a cut row still held goes back
            self.pool.release(self.table[:, cols:][self.table[:, cols:] > 0].tolist())
            self.own = [min(o, cols) for o in self.own]
            self.table = self.table[:, :cols].clone()
        self._held[0] = self.table

    def map_batch(self, fn) -> None:
        """Rows selected, reordered, repeated or appended (``fn`` on the table and the page counts):
        pages no row holds any more go back to the pool; a page two rows now hold is copied."""
        before = set(self.table[self.table > 0].tolist())
        self.table = fn(self.table)
        self.own = fn(torch.tensor(self.own, dtype=torch.long, device=self.table.device)).tolist()
        seen, dup = set(), []
        for r, row in enumerate(self.table.tolist()):
            for c, p in enumerate(row):
                if p > 0:
                    if p in seen:
                        dup.append((r, c, p))
                    seen.add(p)
        if dup:  # repeated rows (beam search): each copy its own pages
            fresh = self.pool.alloc(len(dup))
            for (r, c, p), q in zip(dup, fresh):
                for t in self.pool.tensors:
                    t[q] = t[p]
                self.table[r, c] = q
        self.pool.release(sorted(before - seen))
        self._held[0] = self.table

    def disown(self) -> None:
        """Its rows moved to another store on the same pool: their pages are that store's now."""
        self._held[0] = None
        self.table = self.table[:0]
        self.own = []

    def nbytes(self) -> int:
        return sum(self.own) * self.pool.page_bytes() + self.table.nbytes

    # -- reading and writing -------------------------------------------------------------------
    def _where(self, idx):
        """Physical (page, head, slot) of logical slots ``idx`` (b, h, j)."""
        b, h, j = idx.shape
        page = self.table.gather(1, (idx // self.page).reshape(b, h * j)).view(b, h, j)
        head = torch.arange(h, device=idx.device).view(1, h, 1).expand(b, h, j)
        return page, head, idx % self.page

    def write(self, idx, k, v, take=None) -> None:
        where = self._where(idx)
        if self.packed:
            srcs = [*quantize(k, self.bits, self.group), *quantize(v, self.bits, self.group)]
        else:
            srcs = [k.to(self.pool.tensors[0].dtype), v.to(self.pool.tensors[1].dtype)]
        for t, src in zip(self.pool.tensors, srcs):
            if take is not None:
                src = torch.where(trailing(take, src), src, t[where])
            t[where] = src

    def read(self, idx):
        """Keys and values of slots ``idx`` (b, h, m), in the compute dtype."""
        got = [t[self._where(idx)] for t in self.pool.tensors]
        if self.packed:
            return tuple(dequantize(*part, self.bits, self.group, self.compute_dtype) for part in (got[:3], got[3:]))
        return tuple(t.to(self.compute_dtype) for t in got)

    def _view(self, parts: list):
        """A rectangle store over ``parts`` (what the tier's other reads already know how to read)."""
        if self.packed:
            return PackedStore.over(parts, self.bits, self.group, self.compute_dtype)
        return DenseStore.over(parts[0], parts[1], self.compute_dtype)

    def pieces(self, n: int) -> list:
        """Slots [0, n) for attention's torch path, the rows' pages laid out in a rectangle when a
        piece is first read (decoding reads ``run`` instead: then never)."""
        laid: list = []

        def view():
            if not laid:
                r = self.run(n).rect()
                laid.append(self._view([*r.k, *r.v]).pieces(n))
            return laid[0]

        whole = not self.packed and self.pool.tensors[0].dtype == self.compute_dtype  # DenseStore: one piece
        spans = [(0, n)] if whole else _spans(n)
        return [Piece(e - s, lambda i=i: view()[i].keys(), lambda i=i: view()[i].values())
                for i, (s, e) in enumerate(spans)]

    def run(self, n: int) -> Run:
        """Slots [0, n) as stored, in pages: the pool's tensors and each row's table."""
        parts = self.pool.tensors
        k, v = (tuple(parts[:3]), tuple(parts[3:])) if self.packed else ((parts[0],), (parts[1],))
        bits = self.bits if self.packed else (16 if parts[0].dtype == torch.float16 else 32)
        return Run(bits, self.group if self.packed else 0, k, v, n,
                   table=self.table[:, : -(-n // self.page)], page=self.page)

    @property
    def keys(self):
        return self.pool.tensors[0]

    @property
    def values(self):
        return self.pool.tensors[3 if self.packed else 1]
