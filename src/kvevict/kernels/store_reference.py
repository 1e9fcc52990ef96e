"""The rotation's torch reference (``kvevict.kernels.store.rotate``): x H over the last dimension,
H the normalised Sylvester-Hadamard matrix of the largest power of two n dividing d, block-diagonal
over d, as a fast Walsh-Hadamard transform in float32: log2(n) stages of butterflies (a + b, a - b),
then 1 / sqrt(n). The specification the fused kernels are held to, bit for bit."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _signs(device) -> torch.Tensor:
    """(1, 1, 2, 1): a butterfly's +1 and -1, made once per device (no copy to it per call)."""
    return torch.tensor([1.0, -1.0], device=device).view(1, 1, 2, 1)


def rotate_reference(x: torch.Tensor) -> torch.Tensor:
    """x H (see the module doc). Element by element, so a row's result does not depend on the batch
    around it (a matmul's blocking does, by the last bit, and a bit can flip a stored code: a padded
    batch must store what each row alone stores). A stage is one kernel: its sums and differences are
    a + b * (+1, -1), written straight into the next buffer (b * 1 and b * -1 are exact, so the bits
    are the butterflies')."""
    d = x.shape[-1]
    n = d & -d
    y = x.float().reshape(-1, n)  # every block of n channels of every vector, one per row
    bufs = (torch.empty_like(y), torch.empty_like(y))  # never written into y: it may be x itself
    # traced (torch.compile): made in the graph, which does not trace through an lru_cache
    sign = (
        torch.tensor([1.0, -1.0], device=y.device).view(1, 1, 2, 1)
        if torch.compiler.is_compiling()
        else _signs(y.device)
    )
    h, i = 1, 0
    while h < n:
        a, out = y.view(-1, n // (2 * h), 2, h), bufs[i].view(-1, n // (2 * h), 2, h)
        torch.addcmul(a[:, :, :1], a[:, :, 1:], sign, out=out)
        y, h, i = bufs[i], 2 * h, 1 - i
    return (y.view(x.shape) * n**-0.5).to(x.dtype)
