"""Keys as a low-bit cache stores them: centred per (sequence, KV head) and rotated.

Attention reads a key only through q . k. For any vector c and any orthonormal H (H H^T = I):

    (q H) . ((k - c) H) = q . k - q . c

and q . c is the same for every key one query sees, which softmax cancels: outputs and
probabilities are unchanged. So a layer may store k' = (k - c) H and attend with q' = q H, and
every reader (the torch path, each fused kernel backend) works on k' as it would on k.

Why: keys carry outlier channels (Qwen2's k_proj biases reach 354 where the median channel is
0.7; Llama's keys have milder ones). A per-token group of channels with one step and one zero
spends its 16 int4 levels on the outlier and rounds the rest of its channels to zero. Centring
removes what a channel holds at every position (a bias, or a massive activation on a slowly
rotating RoPE pair); the Hadamard rotation spreads what is left over all channels, so no group
holds an outlier (QuaRot, Ashkboos et al. 2024; KVQuant's per-channel offsets, Hooper et al. 2024,
taken after RoPE so nothing is re-rotated at read). c is the mean key of the row's first forward
over its real tokens: any c is exact, a good one makes the residual small. H is the normalised
Sylvester-Hadamard matrix of the largest power of two dividing head_dim, block-diagonal over the
head dimension. Values keep their own basis: they have no outlier channels (KIVI quantizes them per
token as stored here).
"""

from __future__ import annotations

import functools

import torch

from .kernels.store import fused, rotate

__all__ = ["KeySpace", "hadamard", "rotate"]


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(d: int) -> torch.Tensor:
    """(d, d) float64: block-diagonal normalised Sylvester-Hadamard blocks of the largest power of
    two dividing d (symmetric and orthonormal: H = H^T = H^-1)."""
    n = d & -d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*([h / n**0.5] * (d // n)))


def hadamard(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """H as a matrix (the specification ``rotate`` is held to)."""
    return _hadamard_cpu(d).to(device=device, dtype=dtype)


class KeySpace:
    """One layer's key basis: the per-row centre c (b, hkv, d), float16, and the rotation H (see the
    module doc)."""

    def __init__(self) -> None:
        self.center: torch.Tensor | None = None

    def enter(self, k: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Keys (b, hkv, m, d) as stored: (k - c) H. The first call (each row's first forward) sets c
        to the mean of the row's real keys (``valid`` (b, m) bool; None: all real)."""
        if self.center is None:
            # row by row over a contiguous copy of its real keys: the same sum in the same order as
            # the row alone, so a padded batch stores the same codes (one bit of c apart would not)
            rows = []
            for i in range(k.shape[0]):
                real = k[i].contiguous() if valid is None else k[i][:, valid[i]]
                rows.append(real.float().mean(1) if real.shape[1] else real.new_zeros(k.shape[1], k.shape[3]).float())
            self.center = torch.stack(rows).to(torch.float16)  # any c is exact: the smallest dtype that holds a key
        return rotate(k, self.center)

    def enter_with_query(self, k: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None = None):
        """``(enter(k, valid), query(q))`` in one rotation: keys and queries stacked along the heads
        (a rotation is row by row, so the bits are the same as two calls)."""
        if self.center is None or k.dtype != q.dtype:
            return self.enter(k, valid), self.query(q)
        if fused(k):  # one pass each, the centre given up inside the first
            return rotate(k, self.center), rotate(q)
        both = rotate(torch.cat([k - self.center.unsqueeze(2).to(k.dtype), q], dim=1))
        return both[:, : k.shape[1]], both[:, k.shape[1] :]

    def leave(self, k: torch.Tensor) -> torch.Tensor:
        """The inverse of ``enter``: stored keys back in the model's basis, k' H + c."""
        assert self.center is not None, "enter() sets the centre before any key is stored"
        return rotate(k) + self.center.unsqueeze(2).to(k.dtype)

    @staticmethod
    def query(q: torch.Tensor) -> torch.Tensor:
        """Queries (b, hq, m, d) in the stored keys' basis: q H (the centre needs nothing: see above)."""
        return rotate(q)

    def map_batch(self, fn) -> None:
        if self.center is not None:
            self.center = fn(self.center)

    def tensors(self) -> list:
        return [] if self.center is None else [self.center]

    def nbytes(self) -> int:
        return 0 if self.center is None else self.center.nbytes
