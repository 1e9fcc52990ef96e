"""Per-row pages: a tier's keys, values and bookkeeping in pages of ``PAGE`` slots taken from pools
that every cache made with them shares, each row (sequence) holding only its own pages (vLLM's
PagedAttention, Kwon et al. 2023: a block table per sequence over one pool of blocks).

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
- ``PagedField``: one bookkeeping tensor of a tier (positions, an Ada-KV slot's head id, a policy
  statistic) the same way, each in a pool of its own (a statistic comes and goes with the rows of
  the policy that reads it); the policy ranks it as a rectangle laid out once per step, never kept.

``nbytes`` counts the row's own pages and the table: what the stock cache would hold for the same
tokens, rounded up to a page per (layer, KV head), and the bookkeeping of those slots. The pool's
own size (``PagePool.nbytes``, free pages included) is the server's to report.
"""

from __future__ import annotations

import copy
import weakref

import torch

from ..kernels.runs import Run
from ..kernels.store import quantize_pair
from .codes import dequantize
from .interface import Piece
from .rect import DenseStore, PackedStore, _Packed, _spans, trailing

# slots allocated at a time per (sequence, KV head), in a rectangle's growth as in a pool's pages;
# see docs/results/performance.md ("Paged storage")
PAGE = 32


def page_slots(n: int, budget: int) -> int:
    """Slots to allocate for ``n`` tokens: whole pages, never past the budget."""
    return min(budget, -(-n // PAGE) * PAGE)


class PagePool:
    """Pages of one storage format; ``parts``: (h, width, dtype) of each stored tensor. ``room``:
    () -> bytes the pool may still grow by before a growth takes only what is asked (None: no limit)."""

    def __init__(self, parts: list, device, page: int | None = None, room=None, empty=0):
        self.page, self.room, self.empty = page or PAGE, room, empty
        self.tensors = [torch.full((1, h, self.page, w), empty, dtype=dt, device=device) for h, w, dt in parts]
        self.free: list[int] = []
        # the stores and fields whose tables name its pages
        self.holders: weakref.WeakSet[_PageRows] = weakref.WeakSet()

    def __deepcopy__(self, memo) -> "PagePool":
        return self  # shared by every cache made with it: a copied cache takes pages of the same pool

    @property
    def pages(self) -> int:
        return self.tensors[0].shape[0]

    def page_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def in_use(self) -> int:
        return self.pages - 1 - len(self.free)

    def idle_bytes(self) -> int:
        """Bytes of the pages no row holds: page 0 and the free ones."""
        return (1 + len(self.free)) * self.page_bytes()

    def compact(self) -> None:
        """Give the free pages back: the pages in use past the new end move into free ids below it
        (each holder's table renamed), and the pool keeps page 0 and the pages in use. Only between
        steps: no rectangle or run laid out from the old ids may be used after it."""
        keep = self.in_use() + 1
        if keep == self.pages:
            return
        free = set(self.free)
        low = sorted(i for i in free if i < keep)
        high = [i for i in range(keep, self.pages) if i not in free]
        if high:
            dev = self.tensors[0].device
            src, dst = torch.tensor(high, device=dev), torch.tensor(low, device=dev)
            for t in self.tensors:
                t[dst] = t[src]
            rename = torch.arange(self.pages, device=dev)
            rename[src] = dst
            for holder in list(self.holders):
                holder._rename(rename)
        self.tensors = [t[:keep].clone() for t in self.tensors]
        self.free = []

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            self._grow(n - len(self.free))
        got, self.free = (self.free[-n:][::-1], self.free[:-n]) if n else ([], self.free)
        return got  # ascending ids: a row's consecutive pages lie forward in memory when they can

    def release(self, ids) -> None:
        self.free.extend(int(i) for i in ids if int(i) > 0)

    def _grow(self, n: int) -> None:
        extra = max(n, self.pages // 4)  # a quarter at a time: one copy of the pool per growth
        if self.room is not None:  # never past the limit for the slack alone, and never all that is left of
            # it: the pools of a tier's other per-slot tensors grow for the same rows next
            extra = max(n, min(extra, self.room() // (4 * self.page_bytes())))
        old = self.pages
        self.tensors = [torch.cat([t, t.new_full((extra, *t.shape[1:]), self.empty)]) for t in self.tensors]
        self.free = list(range(old + extra - 1, old - 1, -1)) + self.free  # lowest ids handed out first


class Pools:
    """One ``PagePool`` per storage format, made on first use: what caches sharing pages share.
    ``limit``: bytes the pools grow to for slack (the server's ``kv_memory``); what rows ask for is
    always given (admission keeps that within the limit). ``reserved``: the most bytes the rows now
    admitted can hold (the server's admission bound; None: the pools' own size). A growth takes slack
    only out of limit - reserved - the idle pages, so that reserved + idle <= limit, which
    admission checks, keeps holding: then the pools never pass the limit, since a row's next page
    comes out of its own reservation or out of an idle page."""

    def __init__(self, page: int | None = None, limit: int | None = None):
        self.page, self.limit = page, limit
        self.reserved: int | None = None
        self.pools: dict = {}

    def __deepcopy__(self, memo) -> "Pools":
        return self  # shared, never copied (``_PageRows.__deepcopy__``)

    def _room(self) -> int:
        assert self.limit is not None  # a pool is given this room only under a limit (``get``)
        used = self.nbytes() if self.reserved is None else self.reserved + self.idle_bytes()
        return max(0, self.limit - used)

    def get(self, parts: list, device, empty=0) -> PagePool:
        key = (tuple(parts), str(device), empty)
        if key not in self.pools:
            self.pools[key] = PagePool(parts, device, self.page, None if self.limit is None else self._room, empty)
        return self.pools[key]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pools.values())

    def idle_bytes(self) -> int:
        """Bytes of the pages no row holds (each pool's page 0 and free pages)."""
        return sum(p.idle_bytes() for p in self.pools.values())

    def zero_bytes(self) -> int:
        """Bytes of the pools' pages 0: what they hold with every free page given back."""
        return sum(p.page_bytes() for p in self.pools.values())

    def compact(self) -> None:
        """Every pool gives its free pages back (``PagePool.compact``; only between steps); a pool no
        store or field uses any more goes, page 0 and all."""
        for key, pool in list(self.pools.items()):
            if not pool.holders and not pool.in_use():
                del self.pools[key]
            else:
                pool.compact()

    def pages_in_use(self) -> int:
        return sum(p.in_use() for p in self.pools.values())


def _release(pool: PagePool, held: list) -> None:
    """A dropped store's pages back to its pool (``held[0]``: its table, or None once disowned)."""
    if held[0] is not None:
        pool.release(held[0][held[0] > 0].tolist())
        held[0] = None


class _PageRows:
    """Rows that hold pages of one pool: each row's table of page ids, how many it holds, and the
    page life cycle (given on growth, back when a row leaves or the holder is dropped)."""

    def _take_pool(self, pool: PagePool, b, device) -> None:
        self.pool, self.page = pool, pool.page
        self.table = torch.zeros(b, 0, dtype=torch.long, device=device)
        self.own = [0] * b  # pages each row holds (on the host)
        self._held: list[torch.Tensor | None] = [self.table]  # None once disowned
        weakref.finalize(self, _release, self.pool, self._held)
        pool.holders.add(self)

    def __deepcopy__(self, memo) -> "_PageRows":
        """A copy of these rows (``copy.deepcopy`` of a cache): pages of its own in the same pool."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        mine = ("pool", "page", "table", "own", "_held")
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k not in mine})
        new._take_pool(self.pool, self.table.shape[0], self.table.device)
        new.resize(self.table.shape[1] * self.page)  # a field's laid-out rectangle is dropped: read again
        new.ensure([o * self.page for o in self.own])
        held = self.table > 0  # a row's pages are its first ``own`` columns, in both tables
        for t in self.pool.tensors:
            t[new.table[held]] = t[self.table[held]]
        return new

    def _rename(self, rename: torch.Tensor) -> None:
        """The pool moved pages: page p is now ``rename[p]`` (``PagePool.compact``)."""
        if self._held[0] is not None:
            self.table = rename[self.table]
            self._held[0] = self.table

    def _fresh(self, ids: list) -> None:
        """Pages just handed out (content of an earlier holder): what a new holder needs there."""

    # -- pages ---------------------------------------------------------------------------------
    def ensure(self, fills: list[int]) -> bool:
        """Give each row the pages its first ``fills[r]`` slots need (called before they are written);
        whether any row took one."""
        need = [-(-f // self.page) for f in fills]
        rows: list[int] = []
        cols: list[int] = []
        for r, (n, o) in enumerate(zip(need, self.own)):
            if n > o:
                rows += [r] * (n - o)
                cols += range(o, n)
                self.own[r] = n
        if not rows:
            return False
        if max(cols) >= self.table.shape[1]:
            self.resize((max(cols) + 1) * self.page)
        got = self.pool.alloc(len(rows))
        self._fresh(got)
        dev = self.table.device
        self.table[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(got, device=dev)
        return True

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
        """Its rows moved to another holder on the same pool: their pages are that holder's now."""
        self._held[0] = None
        self.table = self.table[:0]
        self.own = []

    def nbytes(self) -> int:
        return sum(self.own) * self.pool.page_bytes() + self.table.nbytes

    def _where(self, idx):
        """Physical (page, head, slot) of logical slots ``idx`` (b, h, j)."""
        b, h, j = idx.shape
        page = self.table.gather(1, (idx // self.page).reshape(b, h * j)).view(b, h, j)
        head = torch.arange(h, device=idx.device).view(1, h, 1).expand(b, h, j)
        return page, head, idx % self.page


class PagedField(_PageRows):
    """One per-slot bookkeeping tensor of a tier (positions, head ids, a statistic) in pages of its
    own pool, each row holding the pages its fill needs: a short row beside a long one keeps its
    own few, as its keys and values do. ``empty``: what a slot no token holds reads (positions:
    -1); page 0 and every page handed out start so. ``rect(n)`` lays slots [0, n) out as the
    (b, h, n) rectangle the policy ranks, built once until the next change and not kept past it."""

    def __init__(self, pools: Pools, b, h, dtype, empty, device):
        self.empty, self.h = empty, h
        self._rect: torch.Tensor | None = None
        self._full: torch.Tensor | None = None  # the whole pages rect() laid out, _rect its first n slots
        self._take_pool(pools.get([(h, 1, dtype)], device, empty), b, device)

    @property
    def dtype(self):
        return self.pool.tensors[0].dtype

    def _fresh(self, ids: list) -> None:
        self.pool.tensors[0][torch.tensor(ids, device=self.table.device)] = self.empty

    def _changed(self):
        self._rect = self._full = None

    drop_view = _changed

    def _rename(self, rename):
        self._changed()
        super()._rename(rename)

    def ensure(self, fills):
        if super().ensure(fills):  # a page more: the rectangle reads it
            self._changed()

    def resize(self, n, fn=None):
        self._changed()
        super().resize(n, fn)

    def map_batch(self, fn):
        self._changed()
        super().map_batch(fn)

    def disown(self):
        self._changed()
        super().disown()

    def rect(self, n: int) -> torch.Tensor:
        if self._rect is None or self._rect.shape[-1] != n:
            b, cols = self.table.shape[0], -(-n // self.page)
            got = self.pool.tensors[0].index_select(0, self.table[:, :cols].reshape(-1))  # whole pages at once
            self._full = got.view(b, cols, self.h, self.page).permute(0, 2, 1, 3).reshape(b, self.h, cols * self.page)
            self._rect = self._full[..., :n]
        return self._rect

    def write(self, idx, src, take=None) -> None:
        """Slots ``idx`` (b, h, j) <- ``src`` where ``take`` (all where None)."""
        self._changed()
        t = self.pool.tensors[0]
        page, head, slot = self._where(idx)
        src = src.to(t.dtype)
        if take is not None:
            src = torch.where(take, src, t[page, head, slot, 0])
        t[page, head, slot, 0] = src

    def sync(self) -> None:
        """The rectangle ``rect`` gave was changed in place (a statistic accumulated): its pages
        take it back, whole pages at once; it stays current. Page 0 (the slots past a row's own
        pages) is written too and then emptied again: what was written there belongs to no token."""
        if self._rect is None or self._full is None:  # set and cleared together
            raise RuntimeError("sync writes back the rectangle rect() laid out; none is laid out.")
        b, h, w = self._full.shape
        cols = w // self.page
        laid = self._full.view(b, h, cols, self.page).permute(0, 2, 1, 3).reshape(b * cols, h, self.page, 1)
        t = self.pool.tensors[0]
        t.index_copy_(0, self.table[:, :cols].reshape(-1), laid)
        t[0] = self.empty

    def astype(self, pools: Pools, dtype) -> "PagedField":
        """The same rows and slots in a field of ``dtype`` (positions past int16), this one's pages freed."""
        out = PagedField(pools, self.table.shape[0], self.h, dtype, self.empty, self.table.device)
        out.resize(self.table.shape[1] * self.page)
        out.ensure([o * self.page for o in self.own])
        held = self.table > 0
        out.pool.tensors[0][out.table[held]] = self.pool.tensors[0][self.table[held]].to(dtype)
        self.pool.release(self.table[held].tolist())
        self.disown()
        return out


class PagedStore(_PageRows):
    """A tier's keys and values in pages of a shared pool (see the module doc)."""

    def __init__(self, pools: Pools, b, h, dk, dv, dtype, compute_dtype, device, bits=None, group: int = 32):
        self.bits, self.group, self.compute_dtype = bits, group, compute_dtype
        self.packed = bits in (8, 4, 2)
        if self.packed:
            k, v = _Packed(0, h, 0, dk, device, bits, group), _Packed(0, h, 0, dv, device, bits, group)
            parts = [(h, t.shape[-1], t.dtype) for part in (k, v) for t in part.tensors()]
        else:
            parts = [(h, dk, dtype), (h, dv, dtype)]
        self.h = h
        self._take_pool(pools.get(parts, device), b, device)

    # -- reading and writing -------------------------------------------------------------------
    def write(self, idx, k, v, take=None) -> None:
        where = self._where(idx)
        if self.packed:
            srcs = quantize_pair(k, v, self.bits, self.group)
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

        def piece(i: int, s: int, e: int) -> Piece:  # its own closures over i
            return Piece(e - s, lambda: view()[i].keys(), lambda: view()[i].values())

        return [piece(i, s, e) for i, (s, e) in enumerate(spans)]

    def run(self, n: int) -> Run:
        """Slots [0, n) as stored, in pages: the pool's tensors and each row's table."""
        parts = self.pool.tensors
        k, v = (tuple(parts[:3]), tuple(parts[3:])) if self.packed else ((parts[0],), (parts[1],))
        bits = self.bits if self.packed else (16 if parts[0].dtype == torch.float16 else 32)
        return Run(
            bits, self.group if self.packed else 0, k, v, n, table=self.table[:, : -(-n // self.page)], page=self.page
        )

    @property
    def keys(self):
        return self.pool.tensors[0]

    @property
    def values(self):
        return self.pool.tensors[3 if self.packed else 1]
