"""The store path's Triton programs (``kvevict.kernels.store`` on CUDA; on the CPU only in triton's
interpreter, what the tests use). Each is one launch, bit for bit the torch reference:

- ``_rotate_kernel``: a program per block of rows, (x - c) H as log2(n) butterfly stages on the
  row in registers: the stage's pairs are split out of a (..., 2, h) view (a + b, a - b), joined
  back, then * 1 / sqrt(n); x - c is rounded to x's dtype first, as torch subtracts.
- ``_quantize_into_kernel``: a program per (sequence, KV head, new token): the token's groups'
  ranges, step and zero bytes and codes (``kvevict.storage.codes``), packed and written straight
  into its slot of the store, for K and V.
- ``_dequantize_from_kernel``: a program per (sequence, KV head, slot read): the slot's codes
  unpacked and dequantized, for K and V (a demoted token on its way to the next tier).

Rounding to the nearest even integer is (x + 1.5 x 2^23) - 1.5 x 2^23, exact in float32 for
|x| < 2^22 (the values are clamped into that range first, which the final clamps make harmless);
divisions are IEEE (``div_rn``), as torch's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAGIC = 12582912.0  # 1.5 x 2^23


def takes(dk: int, dv: int, group: int) -> bool:
    """Whether the store programs take these head sizes: each holds a token's channels as one block,
    so head sizes and the group must be powers of two, the group no wider than a head."""
    return all(x > 0 and x & (x - 1) == 0 for x in (dk, dv, group)) and group <= min(dk, dv)


@triton.jit
def _rint(x):
    x = tl.minimum(tl.maximum(x, -1048576.0), 1048576.0)
    return (x + _MAGIC) - _MAGIC


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 -> dtype, to the nearest (ties to even) as torch converts; bfloat16 by hand (the
    top 16 bits after adding half an ulp), which the interpreter's cast would truncate."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _rotate_kernel(
    X, Y, C, rows, per, scale,
    D: tl.constexpr, N: tl.constexpr, LOGN: tl.constexpr, BLOCK: tl.constexpr, CENTRED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    ch = tl.arange(0, N)
    for blk in tl.static_range(0, D, N):
        offs = r[:, None] * D + blk + ch[None, :]
        ok = (r < rows)[:, None]
        x = tl.load(X + offs, mask=ok, other=0.0)
        if CENTRED:
            c = tl.load(C + (r // per)[:, None] * D + blk + ch[None, :], mask=ok, other=0.0)
            cx = _round_to(c.to(tl.float32), x.dtype).to(tl.float32)
            x = _round_to(x.to(tl.float32) - cx, x.dtype)
        y = x.to(tl.float32)
        for i in tl.static_range(LOGN):  # stage i: pairs 2^i apart
            y4 = tl.permute(tl.reshape(y, (BLOCK, N >> (i + 1), 2, 1 << i)), (0, 1, 3, 2))
            a, b = tl.split(y4)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK, N))
        tl.store(Y + offs, _round_to(y * scale, Y.dtype.element_ty), mask=ok)


@triton.jit
def _step_byte(s):
    bits = tl.maximum(s, 0.0).to(tl.int32, bitcast=True) + ((1 << 20) - 1)
    u = (bits >> 20) - ((127 - 16) << 3)
    return tl.minimum(tl.maximum(u, 0), 255)


@triton.jit
def _step_value(u):
    return ((u << 20) + ((127 - 16) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_token(x_ptr, codes_ptr, zero_ptr, step_ptr, D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """One token's d channels -> its packed codes, zero bytes and step bytes, stored at the pointers."""
    NG: tl.constexpr = D // GROUP
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER
    levels: tl.constexpr = (1 << BITS) - 1
    units: tl.constexpr = 1 << (8 - BITS)
    g = tl.load(x_ptr + tl.arange(0, D)).to(tl.float32)
    g2 = tl.reshape(g, (NG, GROUP))
    lo = tl.minimum(tl.min(g2, axis=1), 0.0)
    hi = tl.maximum(tl.max(g2, axis=1), 0.0)
    u = _step_byte(tl.math.div_rn(hi - lo, tl.full((NG,), levels, tl.float32)))
    s = _step_value(u)
    bottom = tl.where(hi > -lo, hi - levels * s, lo)
    z = tl.minimum(tl.maximum(_rint(tl.math.div_rn(-bottom * units, s)), 0.0), 255.0)
    q = tl.math.div_rn(g2, s[:, None]) + (z * (1.0 / units))[:, None]  # a power of two: exact
    c = tl.minimum(tl.maximum(_rint(q), 0.0), levels).to(tl.int32)
    # byte j holds channels j, j + W, j + 2W, ... (kvevict.storage.codes.pack): shifted, summed
    c2 = tl.reshape(c, (PER, W))
    shift = (tl.arange(0, PER) * BITS)[:, None]
    packed = tl.sum(c2 << shift, axis=0)
    tl.store(codes_ptr + tl.arange(0, W), packed.to(tl.uint8))
    tl.store(zero_ptr + tl.arange(0, NG), z.to(tl.uint8))
    tl.store(step_ptr + tl.arange(0, NG), u.to(tl.uint8))


@triton.jit
def _quantize_into_kernel(
    K, V, IDX, TAKE,
    KC, KZ, KS, VC, VZ, VS,
    H, J,
    sk0, sk1, sk2, sv0, sv1, sv2, si0, si1, si2,
    kc0, kc1, kc2, kz0, kz1, kz2, ks0, ks1, ks2,
    vc0, vc1, vc2, vz0, vz1, vz2, vs0, vs1, vs2,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_TAKE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    j = pid % J
    h = (pid // J) % H
    b = pid // (J * H)
    go = True
    if HAS_TAKE:
        go = tl.load(TAKE + pid) != 0
    if go:
        slot = tl.load(IDX + b * si0 + h * si1 + j * si2)
        _quantize_token(
            K + b * sk0 + h * sk1 + j * sk2,
            KC + b * kc0 + h * kc1 + slot * kc2,
            KZ + b * kz0 + h * kz1 + slot * kz2,
            KS + b * ks0 + h * ks1 + slot * ks2,
            DK, GROUP, BITS,
        )  # fmt: skip
        _quantize_token(
            V + b * sv0 + h * sv1 + j * sv2,
            VC + b * vc0 + h * vc1 + slot * vc2,
            VZ + b * vz0 + h * vz1 + slot * vz2,
            VS + b * vs0 + h * vs1 + slot * vs2,
            DV, GROUP, BITS,
        )  # fmt: skip


def rotate_triton(x: torch.Tensor, center: torch.Tensor | None = None, block: int = 16) -> torch.Tensor:
    """``kvevict.kernels.store.rotate`` in one launch: x (..., d), center (b, h, d) float16 for x
    (b, h, m, d), or None."""
    d = x.shape[-1]
    n = d & -d
    rows = x.reshape(-1, d).contiguous()
    y = torch.empty_like(rows)
    c = rows if center is None else center.reshape(-1, d).contiguous()  # unread when not centred
    per = 1 if center is None else x.shape[2]
    grid = (triton.cdiv(rows.shape[0], block),)
    _rotate_kernel[grid](
        rows,
        y,
        c,
        rows.shape[0],
        per,
        n**-0.5,
        D=d,
        N=n,
        LOGN=n.bit_length() - 1,
        BLOCK=block,
        CENTRED=center is not None,
    )
    return y.view(x.shape)


def quantize_into_triton(stores, idx, k, v, bits: int, group: int, take=None):
    """``kvevict.kernels.store.quantize_into`` in one launch; NotImplemented for head sizes or groups
    that are not powers of two (a program holds a token's channels as one block)."""
    dk, dv = k.shape[-1], v.shape[-1]
    if not takes(dk, dv, group):
        return NotImplemented
    b, h, j = idx.shape
    if b * h * j == 0:
        return None
    t = idx if take is None else take.expand(idx.shape).contiguous()
    strides = [s for x in (k, v, idx) for s in x.stride()[:3]] + [s for st in stores for s in st.stride()[:3]]
    _quantize_into_kernel[(b * h * j,)](
        k, v, idx, t, *stores, h, j, *strides, DK=dk, DV=dv, GROUP=group, BITS=bits, HAS_TAKE=take is not None
    )
    return None


@triton.jit
def _dequantize_token(codes_ptr, zero_ptr, step_ptr, out_ptr, D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """One stored token -> x_hat = (c U - z) (s / U), rounded once to the output's dtype
    (kvevict.storage.codes.dequantize: c U - z and s / U are exact in it)."""
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER
    units: tl.constexpr = 1 << (8 - BITS)
    i = tl.arange(0, D)
    byte = tl.load(codes_ptr + i % W).to(tl.int32)  # channel i sits in byte i % W, at bits (i // W) x BITS
    c = (byte >> ((i // W) * BITS)) & ((1 << BITS) - 1)
    g = i // GROUP
    z = tl.load(zero_ptr + g).to(tl.int32)
    s = _step_value(tl.load(step_ptr + g).to(tl.int32)) * (1.0 / units)  # a power of two: exact
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    s = _round_to(s, dtype).to(tl.float32)
    tl.store(out_ptr + i, _round_to((c * units - z).to(tl.float32) * s, dtype))


@triton.jit
def _dequantize_from_kernel(
    KC, KZ, KS, VC, VZ, VS, IDX, KO, VO,
    H, J,
    si0, si1, si2,
    kc0, kc1, kc2, kz0, kz1, kz2, ks0, ks1, ks2,
    vc0, vc1, vc2, vz0, vz1, vz2, vs0, vs1, vs2,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    j = pid % J
    h = (pid // J) % H
    b = pid // (J * H)
    slot = tl.load(IDX + b * si0 + h * si1 + j * si2)
    _dequantize_token(
        KC + b * kc0 + h * kc1 + slot * kc2, KZ + b * kz0 + h * kz1 + slot * kz2, KS + b * ks0 + h * ks1 + slot * ks2,
        KO + pid * DK, DK, GROUP, BITS,
    )  # fmt: skip
    _dequantize_token(
        VC + b * vc0 + h * vc1 + slot * vc2, VZ + b * vz0 + h * vz1 + slot * vz2, VS + b * vs0 + h * vs1 + slot * vs2,
        VO + pid * DV, DV, GROUP, BITS,
    )  # fmt: skip


def dequantize_from_triton(stores, idx, bits: int, group: int, dtype):
    """``kvevict.kernels.store.dequantize_from`` in one launch; NotImplemented for head sizes or
    groups that are not powers of two."""
    dk, dv = (stores[i].shape[-1] * 8 // bits for i in (0, 3))
    if not takes(dk, dv, group):
        return NotImplemented
    b, h, j = idx.shape
    k = torch.empty(b, h, j, dk, dtype=dtype, device=idx.device)
    v = torch.empty(b, h, j, dv, dtype=dtype, device=idx.device)
    if b * h * j:
        strides = [*idx.stride()] + [s for st in stores for s in st.stride()[:3]]
        _dequantize_from_kernel[(b * h * j,)](*stores, idx, k, v, h, j, *strides, DK=dk, DV=dv, GROUP=group, BITS=bits)
    return k, v
