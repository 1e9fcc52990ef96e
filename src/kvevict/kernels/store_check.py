"""A store kernel backend checked against the reference on the device it will run on, once, before
its first use (``kvevict.kernels.store``): small random inputs, every dtype and bit width the cache
stores, compared bit for bit."""

from __future__ import annotations

import torch


def agrees(device: str) -> tuple[bool, str]:
    """(whether the Triton store programs give the reference's bits on ``device``, what differed)."""
    from ..storage.codes import dequantize, quantize
    from .store_reference import rotate_reference
    from .triton_store import dequantize_from_triton, quantize_into_triton, rotate_triton

    g = torch.Generator().manual_seed(0)
    b, h, n, j, d, group = 2, 2, 6, 3, 128, 32
    idx = torch.stack([torch.randperm(n, generator=g)[:j] for _ in range(b * h)]).view(b, h, j).to(device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(b, h, j, d, generator=g) * 30).to(dtype).to(device)
        c = (torch.randn(b, h, d, generator=g) * 10).half().to(device)
        if not torch.equal(rotate_triton(x, c), rotate_reference(x - c.unsqueeze(2).to(dtype))):
            return False, f"the rotation differs in {dtype}"
        for bits in (8, 4, 2):
            widths = [d * bits // 8, d // group, d // group] * 2
            stores = [torch.zeros(b, h, n, w, dtype=torch.uint8, device=device) for w in widths]
            want = [t.clone() for t in stores]
            # the reference itself: quantize, one scatter a tensor (quantize_pair would ask for this very check)
            for t, src in zip(want, [*quantize(x, bits, group), *quantize(x.flip(-1), bits, group)]):
                t.scatter_(2, idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1]), src)
            quantize_into_triton(stores, idx, x, x.flip(-1), bits, group)
            if not all(torch.equal(a, w) for a, w in zip(stores, want)):
                return False, f"the {bits}-bit write differs in {dtype}"
            got = dequantize_from_triton(stores, idx, bits, group, dtype)
            for part, out in zip((stores[:3], stores[3:]), got):
                codes, zero, step = (t.gather(2, idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1])) for t in part)
                if not torch.equal(out, dequantize(codes, zero, step, bits, group, dtype)):
                    return False, f"the {bits}-bit read differs in {dtype}"
    return True, ""
