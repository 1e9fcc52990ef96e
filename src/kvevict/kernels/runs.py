"""What a fused decode kernel reads: runs of stored slots, as they are stored (no copy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PACKED_BITS = (8, 4, 2)
DENSE_BITS = (16, 32)


@dataclass
class Run:
    """``n`` consecutive slots of one tier as stored (no copy): a kernel reads them packed.

    bits: 8, 4, 2 (packed codes), 16 (float16 dense) or 32 (the model's dtype, dense).
    group: channels per step / zero-point group (packed only).
    k, v: packed: (codes (b, h, n, d*bits/8), zeros (b, h, n, d/group), steps (same)), all uint8,
          x_hat = step * (code - zero / 2^(8 - bits)) per group (``kvevict.storage.codes.quantize``); dense: (keys (b, h, n, d),).
    h is the number of KV heads, or 1 for an Ada-KV pooled tier (one pool shared by the heads; the
    attention mask then says which head sees which slot). Tensors may be slices [:, :, :n] of larger
    storage: kernels take their strides, they do not copy.
    table: None, or paged storage (``kvevict.storage.paged``): every tensor is a pool (pages, h, page, width)
    and row b's slot i lives at (table[b, i // page], i % page).
    """

    bits: int
    group: int
    k: tuple
    v: tuple
    n: int
    table: torch.Tensor | None = None  # (b, ceil(n / page)) int64 page ids, or None
    page: int = 0

    def rect(self) -> "Run":
        """The same slots as (b, h, n, width) rectangles (a copy of what is stored, still packed)."""
        table = self.table
        if table is None:
            return self
        b, cols = table.shape

        def lay(t):
            return t[table].permute(0, 2, 1, 3, 4).reshape(b, t.shape[1], cols * self.page, t.shape[-1])[:, :, : self.n]

        return Run(self.bits, self.group, tuple(map(lay, self.k)), tuple(map(lay, self.v)), self.n)

    @property
    def packed(self) -> bool:
        return self.bits in PACKED_BITS

    @property
    def heads(self) -> int:
        return self.k[0].shape[1]

    @property
    def paged(self) -> bool:
        return self.table is not None
