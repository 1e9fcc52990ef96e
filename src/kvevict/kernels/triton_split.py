"""Split-K decode attention over packed keys and values dequantized in registers (FlashDecoding, Dao
et al. 2023): ``_split_kernel``, one program per (sequence, KV head, split), streams its keys in
tiles of BLOCK_N, dequantizes them (x_hat = step * (code - zero / 2^(8 - bits)),
``kvevict.storage.codes.quantize``) and runs ``triton_softmax``'s online softmax over them. Imports
triton: load it only through ``triton_decode``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_softmax import (
    _at_row,
    _online,
    _operand,
    _program,
    _query,
    _rnd,
    _slots,
    _softmax_start,
    _step,
    _store_partials,
    _tile,
)


@triton.jit
def _fetch(
    c_ptr,
    z_ptr,
    s_ptr,
    sc_n,
    sc_d,
    sz_n,
    sz_d,
    ss_n,
    ss_d,
    rows,
    nm,
    cols,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """A tile's stored bytes as loaded, not yet used (``_dequant`` reads them): a dense tile's
    values (its zeros and steps are dummies), or packed codes, zeros and steps. Packed: channel c
    of a token sits in byte c % W at bit (c // W) * BITS, W = D * BITS / 8 (``kvevict.storage.codes.pack``),
    its group is c // GROUP. GROUPED (D a power of two and each group inside one W-byte part): read
    as (BLOCK_N, groups, GROUP), a group's bytes one contiguous vector and its zero and step once."""
    valid = nm[:, None] & (cols[None, :] < D)  # rows in the run, channels of the (padded) head dim
    if BITS >= 16:
        x = tl.load(c_ptr + rows[:, None] * sc_n + cols[None, :] * sc_d, mask=valid, other=0.0)
        none = tl.zeros([1], tl.uint8)
        return x, none, none
    elif GROUPED:
        NG: tl.constexpr = D // GROUP
        PART: tl.constexpr = D * BITS // 8 // GROUP  # groups per W-byte part
        gi = tl.arange(0, NG)
        byte = (gi % PART)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (NG, GROUP)
        raw = tl.load(c_ptr + rows[:, None, None] * sc_n + byte[None, :, :] * sc_d, mask=nm[:, None, None], other=0)
        z = tl.load(z_ptr + rows[:, None] * sz_n + gi[None, :] * sz_d, mask=nm[:, None], other=0)
        s = tl.load(s_ptr + rows[:, None] * ss_n + gi[None, :] * ss_d, mask=nm[:, None], other=0)
        return raw, z, s
    else:
        W: tl.constexpr = D * BITS // 8
        gi = cols // GROUP
        raw = tl.load(c_ptr + rows[:, None] * sc_n + (cols % W)[None, :] * sc_d, mask=valid, other=0)
        z = tl.load(z_ptr + rows[:, None] * sz_n + gi[None, :] * sz_d, mask=valid, other=0)
        s = tl.load(s_ptr + rows[:, None] * ss_n + gi[None, :] * ss_d, mask=valid, other=0)
        return raw, z, s


@triton.jit
def _dequant(
    raw,
    z,
    s,
    cols,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr,
):
    """(BLOCK_N, D_P) keys or values from ``_fetch``'s bytes, rounded to the compute dtype CDT (held
    in fp32, or in CDT with LOWP): x_hat = (step / U) * (U code - zero), U = 2^(8 - BITS), exact
    before the one rounding to CDT that ``kvevict.storage.codes.dequantize`` makes too, so both backends see
    the same keys. LOWP (bf16 only): the product taken in bf16, the same one rounding, since
    U code - zero (|.| <= 256) and step / U (a 4-bit mantissa) are exact in bf16 and so is no
    more than their 12-bit product before it rounds."""
    if BITS >= 16:
        return _rnd(raw.to(tl.float32), CDT, EMU)
    elif GROUPED:
        U: tl.constexpr = 1 << (8 - BITS)  # zero units per step
        NG: tl.constexpr = D // GROUP
        PART: tl.constexpr = D * BITS // 8 // GROUP
        shift = ((tl.arange(0, NG) // PART) * BITS)[:, None]
        code = (raw.to(tl.int32) >> shift[None, :, :]) & ((1 << BITS) - 1)
        units = code * U - z.to(tl.int32)[:, :, None]
        if LOWP:
            x = units.to(CDT) * (_step(s) / U).to(CDT)[:, :, None]
        else:
            x = _rnd(units.to(tl.float32) * (_step(s) / U)[:, :, None], CDT, EMU)
        return tl.reshape(x, (BLOCK_N, D))
    else:
        # one constexpr per branch: hoisted above the BITS >= 16 branch it would shift by a negative count
        U: tl.constexpr = 1 << (8 - BITS)  # type: ignore[no-redef]
        W: tl.constexpr = D * BITS // 8
        code = (raw.to(tl.int32) >> ((cols // W) * BITS)[None, :]) & ((1 << BITS) - 1)
        # (U code - zero) * (step / U) is exact in fp32; rounded to CDT once, where torch rounds
        return _rnd((code * U - z.to(tl.int32)).to(tl.float32) * (_step(s) / U), CDT, EMU)


@triton.jit
def _split_kernel(
    q_ptr,
    sq_b,
    sq_h,
    sq_d,
    kc_ptr,
    kz_ptr,
    ks_ptr,
    skc_b,
    skc_h,
    skc_n,
    skc_d,
    skz_b,
    skz_h,
    skz_n,
    skz_d,
    sks_b,
    sks_h,
    sks_n,
    sks_d,
    vc_ptr,
    vz_ptr,
    vs_ptr,
    svc_b,
    svc_h,
    svc_n,
    svc_d,
    svz_b,
    svz_h,
    svz_n,
    svz_d,
    svs_b,
    svs_h,
    svs_n,
    svs_d,
    mask_ptr,
    sm_b,
    sm_h,
    sm_n,
    score_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    n,
    key_off,
    split_off,
    split,
    n_splits,
    nt1,
    scale,
    softcap,
    tab_ptr,
    tab_b,
    page_rows,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    DV: tl.constexpr,
    DV_P: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    GROUPED_K: tl.constexpr,
    GROUPED_V: tl.constexpr,
    PAGED: tl.constexpr = False,
    PAGE: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False,
    LOWP: tl.constexpr = False,
    SCORES: tl.constexpr = True,
):
    """One (sequence, KV head, split) of one run: partial m, l, acc and the raw scores. The scaled
    query, the keys, the values and the probabilities are rounded to the compute dtype CDT where
    the torch reference holds them in it; products accumulate in fp32. PREFETCH: the next tile's
    bytes are loaded before this tile is computed (the loop's runtime bounds keep triton from
    pipelining it). LOWP: see ``_dequant``. SCORES: the raw scores are saved for ``_finish``'s pg
    (off when the caller wants no pg: out only, as SDPA computes)."""
    pid, sp, bi, kh = _program(HKV)
    rows = tl.arange(0, GP)
    rmask = rows < G
    dk = tl.arange(0, D_P)
    dv = tl.arange(0, DV_P)
    q = _query(q_ptr, sq_b, sq_h, sq_d, bi, kh, rows, dk, rmask[:, None] & (dk[None, :] < D), scale, G, CDT, EMU)
    q = _operand(q, CDT, EMU)
    kc_ptr, kz_ptr, ks_ptr = _at_row(kc_ptr, kz_ptr, ks_ptr, skc_b, skc_h, skz_b, skz_h, sks_b, sks_h, bi, kh)
    vc_ptr, vz_ptr, vs_ptr = _at_row(vc_ptr, vz_ptr, vs_ptr, svc_b, svc_h, svz_b, svz_h, svs_b, svs_h, bi, kh)
    start = sp * split  # inline: loop bounds returned by a helper compile to another schedule
    end = tl.minimum(start + split, n)
    m_i, l_i = _softmax_start(GP, BLOCK_N, True)  # l per key column (``_online``'s LCOLS)
    acc = tl.zeros([GP, DV_P], tl.float32)
    if PREFETCH:  # the first tile's bytes
        offs = start + tl.arange(0, BLOCK_N)
        nm, slots = _tile(offs, end, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
        kr, kz, ks = _fetch(
            kc_ptr, kz_ptr, ks_ptr, skc_n, skc_d, skz_n, skz_d, sks_n, sks_d, slots, nm, dk, BITS, GROUP, D, GROUPED_K
        )
        vr, vz, vs = _fetch(
            vc_ptr, vz_ptr, vs_ptr, svc_n, svc_d, svz_n, svz_d, svs_n, svs_d, slots, nm, dv, BITS, GROUP, DV, GROUPED_V
        )
    for t in range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        nm = offs < end
        if PREFETCH:  # the next tile's bytes in flight while this one is computed
            nm_next, slots = _tile(offs + BLOCK_N, end, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
            kr_next, kz_next, ks_next = _fetch(
                kc_ptr,
                kz_ptr,
                ks_ptr,
                skc_n,
                skc_d,
                skz_n,
                skz_d,
                sks_n,
                sks_d,
                slots,
                nm_next,
                dk,
                BITS,
                GROUP,
                D,
                GROUPED_K,
            )
            vr_next, vz_next, vs_next = _fetch(
                vc_ptr,
                vz_ptr,
                vs_ptr,
                svc_n,
                svc_d,
                svz_n,
                svz_d,
                svs_n,
                svs_d,
                slots,
                nm_next,
                dv,
                BITS,
                GROUP,
                DV,
                GROUPED_V,
            )
        else:
            slots = _slots(offs, nm, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
            kr, kz, ks = _fetch(
                kc_ptr,
                kz_ptr,
                ks_ptr,
                skc_n,
                skc_d,
                skz_n,
                skz_d,
                sks_n,
                sks_d,
                slots,
                nm,
                dk,
                BITS,
                GROUP,
                D,
                GROUPED_K,
            )
        k = _dequant(kr, kz, ks, dk, BITS, GROUP, D, CDT, EMU, GROUPED_K, BLOCK_N, LOWP)
        s = tl.dot(q, tl.trans(_operand(k, CDT, EMU)), input_precision="ieee")  # (GP, BLOCK_N), fp32
        p, alpha, m_new, l_i = _online(
            s,
            offs,
            nm,
            m_i,
            l_i,
            rows,
            rmask,
            pid,
            bi,
            kh,
            key_off,
            nt1,
            softcap,
            mask_ptr,
            sm_b,
            sm_h,
            sm_n,
            score_ptr,
            G,
            HAS_MASK,
            SOFTCAP,
            SCORES,
            True,
        )
        if not PREFETCH:
            vr, vz, vs = _fetch(
                vc_ptr,
                vz_ptr,
                vs_ptr,
                svc_n,
                svc_d,
                svz_n,
                svz_d,
                svs_n,
                svs_d,
                slots,
                nm,
                dv,
                BITS,
                GROUP,
                DV,
                GROUPED_V,
            )
        v = _dequant(vr, vz, vs, dv, BITS, GROUP, DV, CDT, EMU, GROUPED_V, BLOCK_N, LOWP)
        pv = tl.dot(_operand(_rnd(p, CDT, EMU), CDT, EMU), _operand(v, CDT, EMU), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if PREFETCH:
            kr, kz, ks, vr, vz, vs = kr_next, kz_next, ks_next, vr_next, vz_next, vs_next
    part = _store_partials(m_ptr, l_ptr, m_i, l_i, pid, n_splits, split_off, sp, rows, rmask, G, True)
    tl.store(acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=rmask[:, None] & (dv[None, :] < DV))
