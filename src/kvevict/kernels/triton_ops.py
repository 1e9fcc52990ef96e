"""The Triton backend's launches as ``torch.library`` custom ops, for a traced step.

Traced (``torch.compile``), the decode attention (``triton_decode``) and each store program
(``triton_store``) is one opaque call with a fake of its shapes, as the CPU backend's kernels are
(``cpu.py``, ``store.py``): dynamo never traces the launch code (the configuration, the grids, the
interpreter), inductor calls the op, and CUDA graphs capture the launches it makes. Eager, the
plain functions run, with no dispatcher in the way. The ops run wherever those functions do: CUDA
tensors, and CPU tensors in triton's interpreter (what the tests compile). Importing this module
does not import triton.

Optional tensors are ``Tensor?`` (never a stand-in tensor on another device: a CPU tensor in a
CUDA graph's inputs makes CUDA graph trees skip the graph).
"""

from __future__ import annotations

import torch

from .runs import PACKED_BITS, Run

_PER_RUN = 4  # meta per run: bits, group, n, page (0: not paged)

_DECODE = (
    "(Tensor q, Tensor k_new, Tensor v_new, Tensor[] tensors, SymInt[] meta, Tensor?[] tables, Tensor? mask, "
    "float scale, float softcap, Tensor[] summary, bool pg) -> (Tensor, Tensor)"
)


def register(registry: dict) -> None:
    """Add the backend to the dispatcher's registry under "triton" (``kvevict.kernels``)."""
    registry["triton"] = decode_attention


def decode_attention(q, runs, k_new, v_new, mask, scale, softcap=None, summary=None, pg=True, **switches):
    """``triton_decode.decode_attention_triton``: called eager; traced, one op call (the switches,
    for tuning runs, are not taken there). NotImplemented where the programs do not run ``q``."""
    from .triton_decode import decode_attention_triton, takes

    if not torch.compiler.is_compiling():
        return decode_attention_triton(q, runs, k_new, v_new, mask, scale, softcap, summary, pg, **switches)
    if not takes(q):
        return NotImplemented
    if switches:
        raise ValueError(f"switches ({', '.join(switches)}) tune eager calls; a traced step takes the defaults.")
    tensors, meta, tables = [], [], []
    for r in runs:
        tensors += [*r.k, *r.v]
        meta += [r.bits, r.group, r.n, r.page if r.paged else 0]
        tables.append(r.table)
    out, probs = torch.ops.kvevict.decode_triton(
        q, k_new, v_new, tensors, meta, tables, mask, float(scale), float(softcap or 0.0), list(summary or ()), pg
    )
    return out, probs if pg else None


def _runs(tensors, meta, tables) -> list:
    runs, at = [], 0
    for i, table in enumerate(tables):
        bits, group, n, page = meta[_PER_RUN * i : _PER_RUN * (i + 1)]
        parts = 3 if bits in PACKED_BITS else 1
        k, v = tuple(tensors[at : at + parts]), tuple(tensors[at + parts : at + 2 * parts])
        at += 2 * parts
        runs.append(Run(bits, group, k, v, n, table, page))
    return runs


@torch.library.custom_op("kvevict::decode_triton", mutates_args=(), schema=_DECODE)
def _decode_op(q, k_new, v_new, tensors, meta, tables, mask, scale, softcap, summary, pg):
    from .triton_decode import decode_attention_triton

    runs = _runs(tensors, meta, tables)
    out, probs = decode_attention_triton(
        q, runs, k_new, v_new, mask, scale, softcap or None, tuple(summary) or None, pg=pg
    )
    return out, probs if pg else q.new_empty(0, dtype=torch.float32)


@_decode_op.register_fake
def _decode_shapes(q, k_new, v_new, tensors, meta, tables, mask, scale, softcap, summary, pg):
    """out (b, hq, 1, dv) in q's dtype; pg (b, hkv, n_total + 1) float32, or empty."""
    b, hq = q.shape[:2]
    out = q.new_empty(b, hq, 1, v_new.shape[-1])
    if not pg:
        return out, q.new_empty(0, dtype=torch.float32)
    n_total = sum(meta[2::_PER_RUN])
    return out, q.new_empty(b, k_new.shape[1], n_total + 1, dtype=torch.float32)


def rotate(x, center=None):
    """``triton_store.rotate_triton``; traced, one op call."""
    if torch.compiler.is_compiling():
        return torch.ops.kvevict.rotate_triton(x, center)
    from .triton_store import rotate_triton

    return rotate_triton(x, center)


@torch.library.custom_op("kvevict::rotate_triton", mutates_args=())
def _rotate_op(x: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor:
    from .triton_store import rotate_triton

    return rotate_triton(x, center)


@_rotate_op.register_fake
def _rotate_shape(x, center):
    return x.new_empty(x.shape)


def quantize_into(stores, idx, k, v, bits: int, group: int, take=None):
    """``triton_store.quantize_into_triton`` (the stores written in place); traced, one op call.
    NotImplemented where its programs do not take these head sizes (``triton_store.takes``)."""
    from .triton_store import quantize_into_triton, takes

    if not torch.compiler.is_compiling():
        return quantize_into_triton(stores, idx, k, v, bits, group, take)
    if not takes(k.shape[-1], v.shape[-1], group):
        return NotImplemented
    torch.ops.kvevict.quantize_into_triton(list(stores), idx, k, v, bits, group, take)
    return None


@torch.library.custom_op("kvevict::quantize_into_triton", mutates_args=("stores",))
def _quantize_into_op(
    stores: list[torch.Tensor],
    idx: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    group: int,
    take: torch.Tensor | None,
) -> None:
    from .triton_store import quantize_into_triton

    quantize_into_triton(stores, idx, k, v, bits, group, take)


@_quantize_into_op.register_fake
def _quantize_into_shape(stores, idx, k, v, bits, group, take):
    return None


def dequantize_from(stores, idx, bits: int, group: int, dtype):
    """``triton_store.dequantize_from_triton``: (k, v); traced, one op call. NotImplemented where
    its programs do not take these head sizes."""
    from .triton_store import dequantize_from_triton, takes

    if not torch.compiler.is_compiling():
        return dequantize_from_triton(stores, idx, bits, group, dtype)
    dk, dv = (stores[i].shape[-1] * 8 // bits for i in (0, 3))
    if not takes(dk, dv, group):
        return NotImplemented
    k, v = torch.ops.kvevict.dequantize_from_triton(list(stores), idx, bits, group, dtype)
    return k, v


@torch.library.custom_op("kvevict::dequantize_from_triton", mutates_args=())
def _dequantize_from_op(
    stores: list[torch.Tensor], idx: torch.Tensor, bits: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_store import dequantize_from_triton

    k, v = dequantize_from_triton(stores, idx, bits, group, dtype)
    return k, v


@_dequantize_from_op.register_fake
def _dequantize_from_shape(stores, idx, bits, group, dtype):
    b, h, j = idx.shape
    dk, dv = (stores[i].shape[-1] * 8 // bits for i in (0, 3))
    return idx.new_empty(b, h, j, dk, dtype=dtype), idx.new_empty(b, h, j, dv, dtype=dtype)
