"""The input checks of the ``"triton"`` decode backend (``triton_decode``): the query, the new key and
value, each stored run and the mask against the interface, before anything is launched, each a
ValueError that says what to change (a bad shape must never reach a kernel, which would read out
of bounds instead of failing)."""

from __future__ import annotations

import torch

PACKED = (8, 4, 2)  # bits of a packed run: codes, zeros and steps (uint8)
DENSE = (16, 32)  # bits of a dense run: fp16, or a float dtype as it is
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, runs, k_new, v_new, mask):
    """Shapes, dtypes and devices against the interface; ValueError saying what to change. Returns
    (b, hq, hkv, d, dv, n_total)."""
    b, hq, hkv, d, dv = _check_new(q, k_new, v_new)
    n_total = 0
    for i, r in enumerate(runs):
        _check_run(i, r, q, b, hkv, d, dv)
        n_total += r.n
    if mask is not None:
        if (
            mask.dtype != torch.bool
            or mask.dim() != 3
            or mask.shape[0] != b
            or mask.shape[1] not in (hkv, 1)
            or mask.shape[2] != n_total
            or mask.device != q.device
        ):
            raise ValueError(
                f"mask must be bool ({b}, {hkv} or 1, {n_total}) on {q.device} over the stored slots, "
                f"got {mask.dtype} {tuple(mask.shape)} on {mask.device}."
            )
    return b, hq, hkv, d, dv, n_total


def _check_new(q, k_new, v_new) -> tuple:
    """The query and the new key and value: (b, hq, hkv, d, dv)."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be (batch, query heads, 1, head_dim) for one decode step, got {tuple(q.shape)}.")
    b, hq, _, d = q.shape
    if k_new.dim() != 4 or k_new.shape[0] != b or k_new.shape[2] != 1 or k_new.shape[3] != d:
        raise ValueError(f"k_new must be ({b}, kv heads, 1, {d}), got {tuple(k_new.shape)}.")
    hkv = k_new.shape[1]
    if hq % hkv:
        raise ValueError(f"the {hq} query heads must be a multiple of the {hkv} KV heads (GQA).")
    if v_new.dim() != 4 or tuple(v_new.shape[:3]) != (b, hkv, 1):
        raise ValueError(f"v_new must be ({b}, {hkv}, 1, head_dim_v), got {tuple(v_new.shape)}.")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device} like q, got {t.dtype} on {t.device}.")
    return b, hq, hkv, d, v_new.shape[3]


def _check_run(i: int, r, q, b: int, hkv: int, d: int, dv: int) -> None:
    """runs[i]: its bits and length, then per side (keys, values) its tensors' count, group, table,
    shapes, devices and dtypes."""
    if r.bits not in PACKED + DENSE:
        raise ValueError(f"runs[{i}].bits must be one of {PACKED + DENSE}, got {r.bits!r}.")
    if r.n < 0:
        raise ValueError(f"runs[{i}].n must be >= 0, got {r.n}.")
    parts = 3 if r.bits in PACKED else 1
    table = getattr(r, "table", None)
    for side, t, width in (("k", r.k, d), ("v", r.v, dv)):
        if len(t) != parts:
            raise ValueError(f"runs[{i}].{side} must hold {parts} tensor(s) for bits={r.bits}, got {len(t)}.")
        shapes = _stored_shapes(i, r, width)
        if table is not None and (
            table.dim() != 2
            or table.shape[0] != b
            or table.dtype != torch.long
            or table.shape[1] * r.page < r.n
            or table.device != q.device
        ):
            raise ValueError(
                f"runs[{i}].table must be int64 ({b}, >= {-(-r.n // max(1, r.page))}) on "
                f"{q.device}, got {table.dtype} {tuple(table.shape)}."
            )
        for x, (last, dtype) in zip(t, shapes):
            _check_stored(f"runs[{i}].{side}", x, r, table is not None, (b, hkv, last), q.device)
            if dtype is not None and x.dtype != dtype:
                raise ValueError(f"runs[{i}].{side} (bits={r.bits}) must be {dtype}, got {x.dtype}.")
            if dtype is None and x.dtype not in _DTYPES:
                raise ValueError(f"runs[{i}].{side} (bits=32) must be a float dtype, got {x.dtype}.")


def _stored_shapes(i: int, r, width: int) -> list:
    """(last dimension, dtype) of each tensor of run i's side of head dim ``width``: codes, zeros and
    steps (uint8) of a packed run, after its group is checked; a dense run's keys (fp16 for 16
    bits, None: any float dtype, for 32)."""
    if r.bits not in PACKED:
        return [(width, torch.float16 if r.bits == 16 else None)]
    if not isinstance(r.group, int) or r.group <= 0 or width % r.group or (width * r.bits) % 8:
        raise ValueError(
            f"runs[{i}].group={r.group!r} must divide the head dimension {width} "
            f"(and {width} * {r.bits} bits must fill whole bytes)."
        )
    return [(width * r.bits // 8, torch.uint8), (width // r.group, torch.uint8), (width // r.group, torch.uint8)]


def _check_stored(name: str, x, r, paged: bool, want: tuple, device) -> None:
    """One stored tensor's shape and device: (b, hkv or 1, >= n, last), or a page pool (pages, hkv
    or 1, page, last) for a paged run; ``want`` is (b, hkv, last)."""
    b, hkv, last = want
    rows_ok = x.shape[2] == r.page if paged else x.shape[0] == b and x.shape[2] >= r.n
    if x.dim() != 4 or not rows_ok or x.shape[1] not in (hkv, 1) or x.shape[3] != last or x.device != device:
        shape = f"pools (pages, {hkv} or 1, {r.page}, {last})" if paged else f"({b}, {hkv} or 1, >= {r.n}, {last})"
        raise ValueError(f"{name} tensors must be {shape} on {device}, got {tuple(x.shape)} on {x.device}.")
