"""One tier's slots as stored, described once (after vLLM's ``get_kv_cache_shape``): the bytes a slot
takes (key and value, position, statistics, a pooled slot's head id), the position width, the page
size and the page tables. ``Storage.slot_bytes`` (a plan, before any tensor exists), ``Tier.nbytes``
(what a cache holds) and the server's budgeter (what a request may hold) all read it; a test holds
it to the bytes of the tensors a tier really holds.

A slot of one (sequence, KV head) holds

    kv + pos + stats + head
    kv    = (dk + dv) x the dtype's bytes (unpacked), or per channel bits / 8 and per group of
            ``group`` channels a step and a zero byte (packed: ``codes``)
    pos   = 2 bytes (int16) while every position of the tier is at most 32,767, else 4 (int32)
    stats = each statistic's dtype bytes (``stats.stat_bytes``); head = 1 byte in a pooled tier

and a paged tier adds, per row and per per-slot tensor (keys and values together, the position,
the head id, each statistic), one page table of ``TABLE_BYTES`` a page column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stats import stat_bytes
from .codes import slot_bytes as kv_slot_bytes

POS16_MAX = torch.iinfo(torch.int16).max  # past it a tier's positions widen to int32 (2 bytes a slot more)
TABLE_BYTES = 8  # a page table entry (int64), per row and page column of each paged tensor


def pos_dtype(last: int) -> torch.dtype:
    """The position width for positions up to ``last``: int16 while they fit (a model's context up
    to 32K: 2 bytes a slot, a sixth of an int4 slot's bookkeeping at head_dim 64), else int32."""
    return torch.int16 if last <= POS16_MAX else torch.int32


@dataclass(frozen=True)
class SlotLayout:
    """A tier's slot layout. ``bits``: None (the model's dtype, ``dtype_bytes`` each), 16, or 8, 4,
    2 (packed codes); ``stats``: the statistics kept per slot; ``pooled``: Ada-KV's shared row,
    each slot's head id beside it; ``page``: slots per page when each row holds its own pages of a
    pool (``kvevict.storage.paged``), None for one rectangle."""

    dk: int
    dv: int
    bits: int | None = None
    group: int = 32
    dtype_bytes: int = 2
    stats: tuple[str, ...] = ()
    pooled: bool = False
    page: int | None = None

    @property
    def kv_bytes(self) -> float:
        """A slot's key and value as stored."""
        return kv_slot_bytes(self.dk, self.dv, self.bits, self.group, self.dtype_bytes)

    @property
    def meta_bytes(self) -> int:
        """A slot's statistics and, pooled, its head id (its position apart: ``slot_bytes``)."""
        return stat_bytes(self.stats) + (1 if self.pooled else 0)

    def slot_bytes(self, pos: torch.dtype = torch.int16) -> float:
        """Every byte of one slot of one (sequence, KV head), with positions of dtype ``pos``."""
        return self.kv_bytes + pos.itemsize + self.meta_bytes

    @property
    def tensors(self) -> int:
        """Per-slot tensors a paged tier keeps in pages, each with its own page table: keys and
        values (one store), positions, head ids (pooled) and each statistic."""
        return 2 + (1 if self.pooled else 0) + len(self.stats)

    def table_bytes(self, rows: int, columns: int) -> int:
        """The page tables of ``rows`` rows ``columns`` pages wide (a rectangle has none)."""
        return 0 if self.page is None else rows * columns * TABLE_BYTES * self.tensors

    def rect_bytes(self, rows: int, heads: int, slots: int, pos: torch.dtype = torch.int16) -> int:
        """A rectangle of ``slots`` slots for each of ``rows`` x ``heads`` (sequence, KV head)."""
        return int(rows * heads * slots * self.slot_bytes(pos))

    def paged_bytes(self, pages: int, heads: int, rows: int, columns: int, pos: torch.dtype = torch.int16) -> int:
        """``pages`` pages held (every row's, of each per-slot tensor alike) and the page tables."""
        assert self.page is not None, "a rectangle holds no pages: rect_bytes"
        return int(pages * heads * self.page * self.slot_bytes(pos)) + self.table_bytes(rows, columns)
