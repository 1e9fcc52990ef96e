"""The store path's kernels, one function each, a plain-torch reference its specification:

- ``rotate(x)``: x H over the last dimension (kvevict.keyspace's key basis), H the normalised
  Sylvester-Hadamard matrix of the largest power of two n dividing d, block-diagonal over d. The
  reference is a fast Walsh-Hadamard transform in float32: log2(n) stages of butterflies
  (a + b, a - b), then 1 / sqrt(n).
- ``quantize_pair(k, v, bits, group)``: ``quantize(k) + quantize(v)`` (kvevict.storage.codes: the
  packed codes, zero bytes and step bytes of K, then of V).
- ``quantize_into(stores, idx, k, v, bits, group, take)``: those codes written straight into slots
  ``idx`` of a packed store's six tensors (its torch path: ``quantize_pair``, then a scatter each);
  ``dequantize_from(stores, idx, bits, group, dtype)`` reads slots back (a gather each, then
  ``dequantize``).

A decode step rotates one key and query and quantizes one token per layer: dozens of small
launches in torch (the butterflies, the groups' ranges, rounding, packing), one pass in a fused
kernel, the way FlashInfer and vLLM append a token to a quantized cache. The compiled CPU backend
(``decode_cpu``'s module, ``store_cpu.cpp``) runs each as one call, bit for bit the reference, and
on CUDA the Triton programs of ``triton_store.py`` do (the rotation, the quantized write and the
read); where neither runs, the reference does. ``$KVEVICT_KERNEL=torch`` picks the reference everywhere
(kvevict.kernels.resolve_backend)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..storage.codes import quantize
from .store_reference import rotate_reference

__all__ = ["backend", "dequantize_from", "fused", "quantize_into", "quantize_pair", "rotate", "rotate_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_CENTER = torch.empty(0, dtype=torch.float16)
_NO_TAKE = torch.empty(0, dtype=torch.bool)
_LIKE = {dtype: torch.empty(0, dtype=dtype) for dtype in _DTYPES}


def backend(x: torch.Tensor) -> str:
    """Where the store path runs ``x``: "cpu" (the compiled module), "triton" (CUDA tensors) or
    "torch" (the reference), as ``resolve_backend`` picks decode attention's backend."""
    return _backend_for(x.device, x.dtype)


def _backend_for(device: torch.device, dtype) -> str:
    from . import resolve_backend  # here: the package imports the storage, which imports this module

    if dtype not in _DTYPES or device.type not in ("cpu", "cuda"):
        return "torch"
    name = resolve_backend(device.type)
    if device.type == "cpu":
        return "cpu" if name == "cpu" else "torch"
    return "triton" if name == "triton" and _triton_agrees(str(device)) else "torch"


@torch.compiler.assume_constant_result
@functools.lru_cache(maxsize=8)
def _triton_agrees(device: str) -> bool:
    """Whether the Triton store programs give the reference's bits on ``device``: checked once per
    device on small inputs (the programs were only run in triton's interpreter when written); a
    program that fails or differs leaves the store path to the reference, said once in the log."""
    import logging

    from .store_check import agrees

    try:
        ok, why = agrees(device)
    except Exception as err:  # a compile error on this GPU, an unsupported op: the reference then runs
        ok, why = False, f"{type(err).__name__}: {err}"
    if not ok:
        logging.getLogger("kvevict.kernels").warning("kvevict store path: torch reference on %s (%s)", device, why)
    return ok


def fused(x: torch.Tensor) -> bool:
    """Whether a fused store kernel takes ``x`` (else the reference runs)."""
    return backend(x) != "torch"


def rotate(x: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    """x H over the last dimension of x (b, h, m, d), or (x - c) H with ``center`` c (b, h, d) in
    float16, subtracted in x's dtype: one pass on the compiled CPU backend, else the reference."""
    d = x.shape[-1]
    odd = center is not None and (center.dtype != torch.float16 or x.dim() != 4 or center.shape != x[:, :, 0].shape)
    where = "torch" if d < 2 or odd else backend(x)
    if where == "torch":
        return rotate_reference(x if center is None else x - center.unsqueeze(2).to(x.dtype))
    if where == "triton":
        from . import triton_ops

        return triton_ops.rotate(x, center)
    n = d & -d
    rows = x.reshape(-1, d)
    c = _NO_CENTER if center is None else center.reshape(-1, d).contiguous()
    per = 1 if center is None else x.shape[2]
    op = torch.ops.kvevict.rotate_cpu if torch.compiler.is_compiling() else _module().rotate
    return op(rows if rows.is_contiguous() else rows.contiguous(), n, n**-0.5, c, per).view(x.shape)


def quantize_pair(k: torch.Tensor, v: torch.Tensor, bits: int, group: int) -> list:
    """``quantize(k) + quantize(v)``: codes, zeros and steps of K, then of V. Keys and values of one
    head size are quantized as one stacked tensor in the reference: every operation is per group of
    one token's channels, so the codes are the same bit for bit, in half the launches."""
    if backend(k) == "cpu" and k.dtype == v.dtype:
        return [*_quantize_fused(k, bits, group), *_quantize_fused(v, bits, group)]
    if k.shape != v.shape:
        return [*quantize(k, bits, group), *quantize(v, bits, group)]
    both = quantize(torch.stack([k, v.to(k.dtype)]), bits, group)
    return [t[0] for t in both] + [t[1] for t in both]


def quantize_into(
    stores: Sequence[torch.Tensor],
    idx: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    group: int,
    take=None,
):
    """``stores`` (codes, zeros, steps of K, then of V; each (b, h, n, width) uint8) at slots ``idx``
    (b, h, j) take the quantized k and v (b, h, j, d) where ``take`` (b, h, j) is True (None:
    everywhere), in one call on the compiled CPU backend or in Triton. NotImplemented where neither
    runs: the store's torch path (``quantize_pair`` and a scatter a tensor, its specification) then writes."""
    where = backend(k)
    if where == "torch" or k.dtype != v.dtype or idx.dtype != torch.long or not idx.shape == k.shape[:3] == v.shape[:3]:
        return NotImplemented
    if any(t.stride(-1) != 1 for t in stores):
        return NotImplemented
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if where == "triton":
        from . import triton_ops

        return triton_ops.quantize_into(stores, idx, k, v, bits, group, take)
    t = _NO_TAKE if take is None else take.expand(idx.shape).contiguous()
    op = torch.ops.kvevict.quantize_into_cpu if torch.compiler.is_compiling() else _module().quantize_into
    op(k, v, idx, t, list(stores), bits, group)
    return None


def dequantize_from(stores: Sequence[torch.Tensor], idx: torch.Tensor, bits: int, group: int, dtype):
    """(k, v) (b, h, j, d) in ``dtype``: slots ``idx`` (b, h, j) of a packed store's six tensors,
    dequantized, in one call on the compiled CPU backend or in Triton (a tier's evicted tokens read
    on their way to the next tier). NotImplemented elsewhere: the store's torch path (a gather each, then
    ``dequantize``, its specification) then reads."""
    where = _backend_for(idx.device, dtype)
    if idx.dtype != torch.long or where == "torch" or any(t.stride(-1) != 1 for t in stores):
        return NotImplemented
    if where == "triton":
        from . import triton_ops

        return triton_ops.dequantize_from(stores, idx, bits, group, dtype)
    like = _LIKE[dtype]  # the outputs' dtype, as a tensor the module's signature takes
    op = torch.ops.kvevict.dequantize_from_cpu if torch.compiler.is_compiling() else _module().dequantize_from
    k, v = op(list(stores), idx, bits, group, like)
    return k, v


def _quantize_fused(x: torch.Tensor, bits: int, group: int) -> tuple:
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    op = torch.ops.kvevict.quantize_cpu if torch.compiler.is_compiling() else _module().quantize
    out = op(rows if rows.is_contiguous() else rows.contiguous(), bits, group)
    cw, ng = d * bits // 8, d // group
    lead = x.shape[:-1]
    return (
        out[:, :cw].view(*lead, cw),
        out[:, cw : cw + ng].view(*lead, ng),
        out[:, cw + ng :].view(*lead, ng),
    )


def _module():
    from .cpu import load

    return load()


@torch.library.custom_op("kvevict::rotate_cpu", mutates_args=())
def _rotate_op(x: torch.Tensor, n: int, scale: float, center: torch.Tensor, per: int) -> torch.Tensor:
    """The compiled module's ``rotate`` as a custom op: ``torch.compile`` keeps it as one opaque call."""
    return _module().rotate(x, n, scale, center, per)


@_rotate_op.register_fake
def _rotate_shape(x, n, scale, center, per):
    return torch.empty_like(x)


@torch.library.custom_op("kvevict::quantize_cpu", mutates_args=())
def _quantize_op(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The compiled module's ``quantize``: (rows, d) -> (rows, codes | zeros | steps) uint8."""
    return _module().quantize(x, bits, group)


@_quantize_op.register_fake
def _quantize_shape(x, bits, group):
    d = x.shape[-1]
    return x.new_empty(x.shape[0], d * bits // 8 + 2 * (d // group), dtype=torch.uint8)


@torch.library.custom_op("kvevict::quantize_into_cpu", mutates_args=("stores",))
def _quantize_into_op(
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    take: torch.Tensor,
    stores: list[torch.Tensor],
    bits: int,
    group: int,
) -> None:
    """The compiled module's ``quantize_into``: writes the six stores in place."""
    _module().quantize_into(k, v, idx, take, stores, bits, group)


@_quantize_into_op.register_fake
def _quantize_into_shape(k, v, idx, take, stores, bits, group):
    return None


@torch.library.custom_op("kvevict::dequantize_from_cpu", mutates_args=())
def _dequantize_from_op(
    stores: list[torch.Tensor], idx: torch.Tensor, bits: int, group: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled module's ``dequantize_from``: the slots ``idx`` of the six stores, dequantized."""
    k, v = _module().dequantize_from(stores, idx, bits, group, like)
    return k, v


@_dequantize_from_op.register_fake
def _dequantize_from_shape(stores, idx, bits, group, like):
    b, h, j = idx.shape
    dk, dv = (stores[i].shape[-1] * 8 // bits for i in (0, 3))
    return like.new_empty(b, h, j, dk), like.new_empty(b, h, j, dv)
