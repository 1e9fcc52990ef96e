"""What a fused decode kernel reads: runs of stored slots, as they are stored (no copy)."""

from __future__ import annotations

from dataclasses import dataclass

PACKED_BITS = (8, 4, 2)
DENSE_BITS = (16, 32)


@dataclass
class Run:
    """``n`` consecutive slots of one tier as stored (no copy): a kernel reads them packed.

    bits: 8, 4, 2 (packed codes), 16 (float16 dense) or 32 (the model's dtype, dense).
    group: channels per step / zero-point group (packed only).
    k, v: packed: (codes (b, h, n, d*bits/8), zeros (b, h, n, d/group), steps (same)), all uint8,
          x_hat = step * (code - zero / 2^(8 - bits)) per group (``kvevict.store.quantize``); dense: (keys (b, h, n, d),).
    h is the number of KV heads, or 1 for an Ada-KV pooled tier (one pool shared by the heads; the
    attention mask then says which head sees which slot). Tensors may be slices [:, :, :n] of larger
    storage: kernels take their strides, they do not copy.
    """

    bits: int
    group: int
    k: tuple
    v: tuple
    n: int

    @property
    def packed(self) -> bool:
        return self.bits in PACKED_BITS

    @property
    def heads(self) -> int:
        return self.k[0].shape[1]
