"""The Triton programs behind ``kvevict.kernels.triton_decode`` (imports triton: load it only
through ``triton_decode``, which checks that triton is there first).

Split-K decode attention (FlashDecoding, Dao et al. 2023): keys are cut into splits; one program
per (sequence, KV head, split) streams its keys in tiles of BLOCK_N, dequantizes them in registers
(x_hat = step * (code - zero / 2^(8 - bits)), ``kvevict.storage.codes.quantize``), and keeps for each query head h of the
KV group an online softmax (Milakov & Gimelshein 2018):

    m_h = max_i s_hi,   l_h = sum_i exp(s_hi - m_h),   acc_h = sum_i exp(s_hi - m_h) v_i

with s_hi = scale * q_h . k_i (fp32 accumulate), softcapped (c * tanh(s / c)) and -inf where
masked. ``_finish`` adds the new key and merges the splits: M = max_j m_j,
L = sum_j l_j exp(m_j - M), out = sum_j acc_j exp(m_j - M) / L, and turns the saved scores into
pg_i = sum_h exp(s_hi - M_h) / L_h, each key's probability summed over the group's heads.
``_split_rows_kernel`` is ``_split_kernel`` for packed runs read factored (its docstring). The two
share the program's setup, the online softmax and the partials' stores (``_program``, ``_query``,
``_at_row``, ``_tile``, ``_softmax_start``, ``_online``, ``_store_partials``); each reads and
multiplies a tile its own way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp (portable across triton versions): exp(-2|x|) never overflows
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _rnd(x, CDT: tl.constexpr, EMU: tl.constexpr):
    """fp32 x rounded to the compute dtype CDT (to nearest, ties to even, as torch rounds), kept in
    fp32. EMU (the interpreter, triton 3.9): its fp32 -> bf16 cast truncates, so bf16 rounding is
    done on the bits there."""
    if CDT == tl.float32:
        return x
    elif EMU and CDT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(CDT).to(tl.float32)


@triton.jit
def _operand(x, CDT: tl.constexpr, EMU: tl.constexpr):
    """A CDT-valued fp32 tile as a tl.dot operand: in CDT (tensor cores on a GPU); in fp32 in the
    interpreter, whose tl.dot multiplies bf16's raw uint16 bits (triton 3.9). bf16 and fp16
    products are exact in fp32, so only the summation order differs."""
    if EMU:
        return x
    else:
        return x.to(CDT)


@triton.jit
def _step(u):
    """Step bytes -> fp32 steps (``kvevict.storage.codes.step_value``; 16 is ``kvevict.storage.codes.STEP_BIAS``)."""
    return ((u.to(tl.int32) << 20) + ((127 - 16) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _slots(offs, nm, tab_ptr, tab_row, page_rows, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Row indices of a tile's slots: the slots themselves, or (paged) slot i % PAGE of page
    tab[i // PAGE] in slot-stride units."""
    if PAGED:
        pg = tl.load(tab_ptr + tab_row + offs // PAGE, mask=nm, other=0)
        return pg * page_rows + offs % PAGE
    else:
        return offs


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
def _program(HKV: tl.constexpr):
    """A program's (pid = sequence x KV head, its second index: the split or block, sequence bi,
    KV head kh)."""
    pid = tl.program_id(0).to(tl.int64)  # offsets of big batches overflow int32
    return pid, tl.program_id(1), pid // HKV, pid % HKV


@triton.jit
def _at_row(c, z, s, sc_b, sc_h, sz_b, sz_h, ss_b, ss_h, bi, kh):
    """One side's three stored tensors' (codes, zeros, steps) pointers at sequence bi, KV head kh (a
    pooled run, one head, arrives with head strides 0; a paged one with batch strides 0)."""
    return c + bi * sc_b + kh * sc_h, z + bi * sz_b + kh * sz_h, s + bi * ss_b + kh * ss_h


@triton.jit
def _tile(offs, end, tab_ptr, tab_row, page_rows, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """The keys ``offs`` of a tile: (which are the split's, their rows: ``_slots``)."""
    nm = offs < end
    return nm, _slots(offs, nm, tab_ptr, tab_row, page_rows, PAGED, PAGE)


@triton.jit
def _query(
    q_ptr, sq_b, sq_h, sq_d, bi, kh, rows, cols, mask, scale, G: tl.constexpr, CDT: tl.constexpr, EMU: tl.constexpr
):
    """Query heads ``rows`` of KV group (bi, kh) at channels ``cols`` (rows x cols; 0 outside
    ``mask``), scaled in the compute dtype as the reference does, held in fp32."""
    q = tl.load(q_ptr + bi * sq_b + (kh * G + rows[:, None]) * sq_h + cols[None, :] * sq_d, mask=mask, other=0.0)
    return _rnd(q.to(tl.float32) * scale, CDT, EMU)


@triton.jit
def _softmax_start(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LCOLS: tl.constexpr):
    """``_online``'s state before the first tile: the running max and normalizer of ROWS rows."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    if LCOLS:
        l_i = tl.zeros([ROWS, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i


@triton.jit
def _store_partials(
    m_ptr, l_ptr, m_i, l_i, pid, n_splits, split_off, sp, rows, rmask, G: tl.constexpr, LCOLS: tl.constexpr
):
    """A split's softmax max and normalizer to its rows of the partials; returns those rows' index
    (the caller stores acc at part * DV + channel)."""
    part = (pid * n_splits + split_off + sp) * G + rows
    tl.store(m_ptr + part, m_i, mask=rmask)
    tl.store(l_ptr + part, _normalizer(l_i, LCOLS), mask=rmask)
    return part


@triton.jit
def _online(
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
    G: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SCORES: tl.constexpr,
    LCOLS: tl.constexpr = False,
):
    """One tile's scores s (rows, BLOCK_N) into the online softmax: softcapped, -inf where masked,
    saved for pg (SCORES); returns (p, alpha, the new max, the new normalizer). LCOLS: the
    normalizer kept per (row, key column), l_i (rows, BLOCK_N), summed along the keys once after
    the loop (``_normalizer``): no reduction across the tile's warps each tile, for a few registers."""
    if SOFTCAP:
        s = _tanh(s / softcap) * softcap
    visible = nm
    if HAS_MASK:
        seen = tl.load(mask_ptr + bi * sm_b + kh * sm_h + (key_off + offs) * sm_n, mask=nm, other=0)
        visible = visible & (seen != 0)
    s = tl.where(visible[None, :], s, float("-inf"))
    if SCORES:
        tl.store(
            score_ptr + ((pid * G + rows[:, None]) * nt1 + key_off + offs[None, :]),
            s,
            mask=rmask[:, None] & nm[None, :],
        )
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    if LCOLS:
        l_new = l_i * alpha[:, None] + p
    else:
        l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def _normalizer(l_i, LCOLS: tl.constexpr):
    """The softmax normalizer of ``_online``'s l_i (LCOLS: its columns summed)."""
    if LCOLS:
        l_i = tl.sum(l_i, axis=1)
    return l_i


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


@triton.jit
def _word_order(D: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, LANES: tl.constexpr = False):
    """The order the factored kernel holds a token's channels in, each 32-bit word's PER = 32 / BITS
    codes together: position w PER + j holds the code at bit b of word w, which is channel
    ((b % 8) // BITS) W + 4 w + b // 8 (byte 4 w + b // 8, part (b % 8) // BITS; ``kvevict.storage.codes.pack``,
    W = D BITS / 8), with b = 8 (j % 4) + BITS (j // 4), or with MAGIC (``_unpack``) b = BITS (j // 2)
    + 16 (j % 2). LANES (with MAGIC; ``_key_words``): position p = 16 (cc CL + cl) + 8 h + 2 t + e
    (CL = 8 / BITS, CC = D BITS / 128) holds word t CC + cc, j = 2 (2 cl + h) + e: lane t of a
    quad, which a tensor-core operand gives columns 16 c + 2 t + {0, 1, 8, 9}, finds them all in
    its own CC words. Returns each position's channel, (D,)."""
    W: tl.constexpr = D * BITS // 8
    PER: tl.constexpr = 32 // BITS
    pos = tl.arange(0, D)
    if LANES:
        CL: tl.constexpr = 8 // BITS
        CC: tl.constexpr = D * BITS // 128
        e = pos % 2
        t = (pos // 2) % 4
        h = (pos // 8) % 2
        cl = (pos // 16) % CL
        cc = pos // (16 * CL)
        word = t * CC + cc
        j = 2 * (2 * cl + h) + e
    else:
        word = pos // PER
        j = pos % PER
    if MAGIC:
        b = BITS * (j // 2) + 16 * (j % 2)
    else:
        b = 8 * (j % 4) + BITS * (j // 4)
    return ((b % 8) // BITS) * W + 4 * word + b // 8


@triton.jit
def _words(c_ptr, sc_n, sc_d, rows, nm, NW: tl.constexpr):
    """(BLOCK_N, NW) int32 words of a tile's packed codes (a quarter of the loads of bytes)."""
    return tl.load(c_ptr + rows[:, None] * sc_n + tl.arange(0, NW)[None, :] * sc_d, mask=nm[:, None], other=0)


@triton.jit
def _key_words(
    c_ptr,
    sc_n,
    sc_d,
    slots,
    nm,
    t,
    end,
    tab_ptr,
    tab_row,
    page_rows,
    NW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    LANES: tl.constexpr,
):
    """The keys' (BLOCK_N, NW) words of the tile at t: ``_words`` at ``slots``, or with LANES
    (TRANS: the keys are a warpgroup MMA's first operand, its rows the tokens) loaded as (8, 4, 2,
    BLOCK_N / 64, NW), row 64 a + 16 b + 8 c + d at [d, b, c, a], so that the coalesced layout
    triton gives the load (lanes along d and the words, 4 warps along b, registers along c and a)
    holds each thread's rows where the MMA wants them, and each lane the words of its columns
    (``_word_order``'s LANES): no layout conversion between the load and the product."""
    # one return after the branches: triton compiles what follows a return in a constexpr branch
    if LANES:
        A: tl.constexpr = BLOCK_N // 64
        d = tl.arange(0, 8)[:, None, None, None, None]
        b = tl.arange(0, 4)[None, :, None, None, None]
        c = tl.arange(0, 2)[None, None, :, None, None]
        a = tl.arange(0, A)[None, None, None, :, None]
        offs = t + 64 * a + 8 * c + 16 * b + d
        inside = offs < end
        rows = _slots(offs, inside, tab_ptr, tab_row, page_rows, PAGED, PAGE)
        w = tl.load(c_ptr + rows * sc_n + tl.arange(0, NW)[None, None, None, None, :] * sc_d, mask=inside, other=0)
        words = tl.reshape(tl.permute(w, (3, 1, 2, 0, 4)), (BLOCK_N, NW))
    else:
        words = _words(c_ptr, sc_n, sc_d, slots, nm, NW)
    return words


@triton.jit
def _or_magic(x, MASK: tl.constexpr, MAGIC: tl.constexpr, EMU: tl.constexpr):
    """(x & MASK) | MAGIC, on a GPU as one lop3 (written as and + or, ptxas emits two: the two
    immediates do not fit one instruction)."""
    if EMU:
        return (x & MASK) | MAGIC
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, $3, 0xEA;",
        "=r,r,r,r",
        [x, tl.full([1], MASK, tl.int32), tl.full([1], MAGIC, tl.int32)],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _halves(t, CDT: tl.constexpr, EMU: tl.constexpr):
    """int32 t read as two CDT (bf16 / fp16) numbers, low half first: t's shape plus an axis of 2.
    On a GPU one PTX move splits the register; in the interpreter, which has no 16-bit bitcast of
    bf16, a bf16's bits are the top half of an fp32's."""
    lo = t & 0xFFFF
    hi = (t >> 16) & 0xFFFF
    if EMU and CDT == tl.bfloat16:
        return tl.join((lo << 16).to(tl.float32, bitcast=True), (hi << 16).to(tl.float32, bitcast=True))
    x = tl.join(lo.to(tl.int16).to(CDT, bitcast=True), hi.to(tl.int16).to(CDT, bitcast=True))
    if EMU:
        return x.to(tl.float32)
    return x


@triton.jit
def _unpack(
    words,
    D: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAGIC: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    FOLD: tl.constexpr = False,
    LANES: tl.constexpr = False,
):
    """(BLOCK_N, D) codes in ``_word_order``: fp32 integers, or with MAGIC (2 or 4 bits, a bf16 /
    fp16 CDT) CDT integers made without an int -> float conversion (a quarter-rate instruction on
    a GPU): two codes at a time, each code's bits or-ed under the exponent of B = 128 (bf16, 0x4300)
    or 1024 (fp16, 0x6400) read as the number B + code (exact: the code fits the mantissa), then
    B subtracted (exact) in CDT's paired arithmetic, or with FOLD left on (B + code: the caller
    takes B off with the zeros, once per token and group instead of once per code pair)."""
    if MAGIC:
        HALF: tl.constexpr = 16 // BITS  # codes per 16-bit half of a word
        ONE: tl.constexpr = (1 << BITS) - 1
        BF: tl.constexpr = CDT == tl.bfloat16
        EXP: tl.constexpr = 0x4300 if BF else 0x6400
        BIAS: tl.constexpr = 128.0 if BF else 1024.0
        sh = tl.arange(0, HALF) * BITS
        t = _or_magic(words[:, :, None] >> sh[None, None, :], ONE * 0x10001, EXP * 0x10001, EMU)  # (BLOCK_N, NW, HALF)
        x = _halves(t, CDT, EMU)  # (BLOCK_N, NW, HALF, 2)
        if LANES:  # to _word_order's LANES positions
            CC: tl.constexpr = D * BITS // 128
            x = tl.reshape(x, (BLOCK_N, 4, CC, HALF // 2, 2, 2))
            x = tl.permute(x, (0, 2, 3, 4, 1, 5))
        if FOLD:
            return tl.reshape(x, (BLOCK_N, D))
        return tl.reshape(x, (BLOCK_N, D)) - BIAS
    else:
        PER: tl.constexpr = 32 // BITS
        j = tl.arange(0, PER)
        shift = (j % 4) * 8 + (j // 4) * BITS
        codes = (words[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)  # >> sign-extends; the mask drops it
        return tl.reshape(codes, (BLOCK_N, D)).to(tl.float32)


@triton.jit
def _word_pairs(
    c_ptr,
    sc_n,
    sc_d,
    t,
    end,
    tab_ptr,
    tab_row,
    page_rows,
    NW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """(NW, BLOCK_N / 2, 2) int32 words of a tile's packed codes, [w, i, e] word w of token t + 2 i + e
    (``_unpack_pairs``)."""
    offs = t + 2 * tl.arange(0, BLOCK_N // 2)[:, None] + tl.arange(0, 2)[None, :]  # (BLOCK_N / 2, 2)
    nm = offs < end
    rows = _slots(offs, nm, tab_ptr, tab_row, page_rows, PAGED, PAGE)
    return tl.load(
        c_ptr + rows[None, :, :] * sc_n + tl.arange(0, NW)[:, None, None] * sc_d, mask=nm[None, :, :], other=0
    )


@triton.jit
def _pick(a, b, sel, EMU: tl.constexpr):
    """Byte j of a as byte 0 and byte j of b as byte 2, for the prmt selector sel = j | j << 4 |
    (4 + j) << 8 | (4 + j) << 12: on a GPU one prmt (bytes 1 and 3 then copies of 0 and 2), in the
    interpreter shifts (bytes 1 and 3 zero); the caller masks both off."""
    if EMU:
        return ((a >> ((sel & 3) * 8)) & 0xFF) | (((b >> (((sel >> 8) & 3) * 8)) & 0xFF) << 16)
    else:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _unpack_pairs(
    pairs,
    D: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    FOLD: tl.constexpr,
):
    """(D, BLOCK_N) codes of ``_word_pairs``' words, channels in ``_word_order`` 0 by tokens: CDT
    numbers made from their bits as ``_unpack``'s MAGIC makes them, but each 32-bit pair holding one
    channel of two neighbouring tokens (byte j of both words side by side, one prmt, then the code's
    shift and one lop3), so the pairs run along the tokens, the axis the value product sums over,
    as the tensor cores take a second operand's pairs: the tile reaches them without a pass through
    shared memory. FOLD as in ``_unpack``."""
    ONE: tl.constexpr = (1 << BITS) - 1
    CPB: tl.constexpr = 8 // BITS  # codes per byte
    BF: tl.constexpr = CDT == tl.bfloat16
    EXP: tl.constexpr = 0x4300 if BF else 0x6400
    BIAS: tl.constexpr = 128.0 if BF else 1024.0
    we, wo = tl.split(pairs)  # (NW, BLOCK_N / 2): even and odd tokens' words
    j = tl.arange(0, 4)
    sel = (j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12))[None, :, None]
    d = _pick(we[:, None, :], wo[:, None, :], sel, EMU)  # (NW, 4, BLOCK_N / 2): byte j of both
    sh = (tl.arange(0, CPB) * BITS)[None, :, None, None]
    t = _or_magic(d[:, None, :, :] >> sh, ONE * 0x10001, EXP * 0x10001, EMU)  # (NW, CPB, 4, BLOCK_N / 2)
    x = tl.reshape(_halves(t, CDT, EMU), (D, BLOCK_N))
    if FOLD:
        return x
    return x - BIAS


@triton.jit
def _per_group(
    x_ptr, sx_n, sx_d, rows, nm, NG: tl.constexpr, NGP: tl.constexpr, BLOCK_N: tl.constexpr, ZW: tl.constexpr
):
    """(NGP, BLOCK_N) bytes of a group-wise tensor (zeros or steps); groups past NG read 0. ZW (NG =
    NGP, a multiple of 4; ``x_ptr`` int32, strides in words): a token's bytes loaded as 32-bit
    words, group 4 i + j in byte j of word i (a quarter of the load instructions of bytes)."""
    if ZW:
        NGW: tl.constexpr = NG // 4
        w = tl.load(x_ptr + rows[None, :] * sx_n + tl.arange(0, NGW)[:, None] * sx_d, mask=nm[None, :], other=0)
        return tl.reshape((w[:, None, :] >> (8 * tl.arange(0, 4))[None, :, None]) & 255, (NG, BLOCK_N))
    else:
        g = tl.arange(0, NGP)
        return tl.load(x_ptr + rows[None, :] * sx_n + g[:, None] * sx_d, mask=(g < NG)[:, None] & nm[None, :], other=0)


@triton.jit
def _split_rows_kernel(
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
    GH: tl.constexpr,
    NGP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    U: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    MAGIC: tl.constexpr = False,
    ZW: tl.constexpr = False,
    FOLD: tl.constexpr = False,
    VPAIR: tl.constexpr = False,
    SCORES: tl.constexpr = True,
    TRANS: tl.constexpr = False,
    LCOLS: tl.constexpr = False,
):
    """``_split_kernel`` for a packed run read factored (``triton_decode._factored``): with
    x_hat = step_g / U (U code - zero_g) per group g of a token,

        q . k_hat = sum_g step_g (q_g . code_g - zero_g / U sum(q_g))
        sum_i p_i v_hat_i[c] = sum_i w_i (U code_ic - zero_i),  w_i = p_i step_i / U, c in group g

    so the codes go to the tensor cores as they are (small integers, exact in any float dtype) and
    only a zero and a step per (token, group) are arithmetic. The codes are read as 32-bit words
    (the pointers ``kc_ptr`` / ``vc_ptr`` are int32, their strides in words) and held in
    ``_word_order``: the query's channels are loaded in that order and the output stored from it.
    Both products run with M = NGP GH rows, row r = g GH + h pairing query head h with group g: the
    query's row holds only group g's channels, and the value product's row r is read only at group
    g's channels. The online softmax runs on the G heads alone. Keys and values are used at their
    exact dequantized values (no rounding to CDT); the weights w are rounded to CDT, as the
    reference rounds p. PREFETCH: as in ``_split_kernel`` (a tile's words and group bytes are few
    registers here). FOLD (with MAGIC): the codes arrive as B + code (``_unpack``), B = 128 (bf16) or
    1024 (fp16), and B joins the zeros: zero_g / U + B for the keys, zero_i + U B for the values
    (exact in fp32; the products' sums then carry B sum(q_g) or U B sum(w), which fp32 holds to a
    relative 2^-24 of that, about 1e-6 of a score). VPAIR (with MAGIC): the values' codes are made
    in pairs of neighbouring tokens (``_unpack_pairs``, their channels in ``_word_order`` 0), the
    pairs the value product's second operand takes, so that tile skips a pass through shared memory.
    SCORES: as in ``_split_kernel``. TRANS: both products transposed, the codes their first operand
    (tokens x channels for the keys, channels x tokens for the values: 128 rows, which an sm_90
    GPU gives a warpgroup MMA, the query and the weights its second, from shared memory) and the
    keys' words loaded where that operand wants them (``_key_words``); the same sums. LCOLS: see
    ``_online`` (off with TRANS, whose program would spill for it)."""
    pid, sp, bi, kh = _program(HKV)
    M: tl.constexpr = NGP * GH
    B: tl.constexpr = (128.0 if CDT == tl.bfloat16 else 1024.0) if (MAGIC and FOLD) else 0.0
    NGK: tl.constexpr = D // GROUP
    NGV: tl.constexpr = DV // GROUP
    NWK: tl.constexpr = D * BITS // 32
    NWV: tl.constexpr = DV * BITS // 32
    r = tl.arange(0, M)
    rg = r // GH  # the row's group
    rh = r % GH  # the row's query head
    heads = tl.arange(0, GH)
    hmask = heads < G
    KL: tl.constexpr = TRANS and MAGIC and BLOCK_N % 64 == 0 and (D * BITS) % 128 == 0  # keys in lanes order
    ck = _word_order(D, BITS, MAGIC, KL)
    cv = _word_order(DV, BITS, MAGIC and not VPAIR)
    qmask = ((rg < NGK) & (rh < G))[:, None] & ((ck // GROUP)[None, :] == rg[:, None])  # row r: group g only
    qx = _query(q_ptr, sq_b, sq_h, sq_d, bi, kh, rh, ck, qmask, scale, G, CDT, EMU)
    q_sum = tl.reshape(tl.sum(qx, axis=1), (NGP, GH))  # head h's scaled query summed over group g
    qx = _operand(qx, CDT, EMU)
    kc_ptr, kz_ptr, ks_ptr = _at_row(kc_ptr, kz_ptr, ks_ptr, skc_b, skc_h, skz_b, skz_h, sks_b, sks_h, bi, kh)
    vc_ptr, vz_ptr, vs_ptr = _at_row(vc_ptr, vz_ptr, vs_ptr, svc_b, svc_h, svz_b, svz_h, svs_b, svs_h, bi, kh)
    start = sp * split  # inline: loop bounds returned by a helper compile to another schedule
    end = tl.minimum(start + split, n)
    m_i, l_i = _softmax_start(GH, BLOCK_N, LCOLS)
    acc = tl.zeros([M, DV], tl.float32)
    if PREFETCH:  # the first tile's bytes
        offs = start + tl.arange(0, BLOCK_N)
        nm, slots = _tile(offs, end, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
        kw = _key_words(
            kc_ptr, skc_n, skc_d, slots, nm, start, end, tab_ptr, bi * tab_b, page_rows, NWK, BLOCK_N, PAGED, PAGE, KL
        )
        kzr = _per_group(kz_ptr, skz_n, skz_d, slots, nm, NGK, NGP, BLOCK_N, ZW)
        ksr = _per_group(ks_ptr, sks_n, sks_d, slots, nm, NGK, NGP, BLOCK_N, ZW)
        if VPAIR:
            vw = _word_pairs(
                vc_ptr, svc_n, svc_d, start, end, tab_ptr, bi * tab_b, page_rows, NWV, BLOCK_N, PAGED, PAGE
            )
        else:
            vw = _words(vc_ptr, svc_n, svc_d, slots, nm, NWV)
        vzr = _per_group(vz_ptr, svz_n, svz_d, slots, nm, NGV, NGP, BLOCK_N, ZW)
        vsr = _per_group(vs_ptr, svs_n, svs_d, slots, nm, NGV, NGP, BLOCK_N, ZW)
    for t in range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        nm = offs < end
        if PREFETCH:  # the next tile's bytes in flight while this one is computed
            nm_next, slots = _tile(offs + BLOCK_N, end, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
            kw_next = _key_words(
                kc_ptr,
                skc_n,
                skc_d,
                slots,
                nm_next,
                t + BLOCK_N,
                end,
                tab_ptr,
                bi * tab_b,
                page_rows,
                NWK,
                BLOCK_N,
                PAGED,
                PAGE,
                KL,
            )
            kzr_next = _per_group(kz_ptr, skz_n, skz_d, slots, nm_next, NGK, NGP, BLOCK_N, ZW)
            ksr_next = _per_group(ks_ptr, sks_n, sks_d, slots, nm_next, NGK, NGP, BLOCK_N, ZW)
            if VPAIR:
                vw_next = _word_pairs(
                    vc_ptr, svc_n, svc_d, t + BLOCK_N, end, tab_ptr, bi * tab_b, page_rows, NWV, BLOCK_N, PAGED, PAGE
                )
            else:
                vw_next = _words(vc_ptr, svc_n, svc_d, slots, nm_next, NWV)
            vzr_next = _per_group(vz_ptr, svz_n, svz_d, slots, nm_next, NGV, NGP, BLOCK_N, ZW)
            vsr_next = _per_group(vs_ptr, svs_n, svs_d, slots, nm_next, NGV, NGP, BLOCK_N, ZW)
        else:
            slots = _slots(offs, nm, tab_ptr, bi * tab_b, page_rows, PAGED, PAGE)
            kw = _key_words(
                kc_ptr, skc_n, skc_d, slots, nm, t, end, tab_ptr, bi * tab_b, page_rows, NWK, BLOCK_N, PAGED, PAGE, KL
            )
            kzr = _per_group(kz_ptr, skz_n, skz_d, slots, nm, NGK, NGP, BLOCK_N, ZW)
            ksr = _per_group(ks_ptr, sks_n, sks_d, slots, nm, NGK, NGP, BLOCK_N, ZW)
        kc = _unpack(kw, D, BITS, BLOCK_N, MAGIC, CDT, EMU, FOLD, KL)
        if TRANS:  # (BLOCK_N, D) x (D, M), transposed back
            qc = tl.trans(tl.dot(_operand(kc, CDT, EMU), tl.trans(qx), input_precision="ieee"))
        else:
            qc = tl.dot(qx, tl.trans(_operand(kc, CDT, EMU)), input_precision="ieee")  # (M, BLOCK_N), exact products
        qc = tl.reshape(qc, (NGP, GH, BLOCK_N))
        kst = _step(ksr)[:, None, :]
        s = tl.sum(
            kst * qc - (kst * (kzr.to(tl.float32) / U + B)[:, None, :]) * q_sum[:, :, None], axis=0
        )  # (GH, BLOCK_N)
        p, alpha, m_new, l_i = _online(
            s,
            offs,
            nm,
            m_i,
            l_i,
            heads,
            hmask,
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
            LCOLS,
        )
        if not PREFETCH:
            if VPAIR:
                vw = _word_pairs(
                    vc_ptr, svc_n, svc_d, t, end, tab_ptr, bi * tab_b, page_rows, NWV, BLOCK_N, PAGED, PAGE
                )
            else:
                vw = _words(vc_ptr, svc_n, svc_d, slots, nm, NWV)
            vzr = _per_group(vz_ptr, svz_n, svz_d, slots, nm, NGV, NGP, BLOCK_N, ZW)
            vsr = _per_group(vs_ptr, svs_n, svs_d, slots, nm, NGV, NGP, BLOCK_N, ZW)
        if VPAIR:  # (DV, BLOCK_N) transposed: pairs along the tokens, as the product takes them
            vc = tl.trans(_unpack_pairs(vw, DV, BITS, BLOCK_N, CDT, EMU, FOLD))
        else:
            vc = _unpack(vw, DV, BITS, BLOCK_N, MAGIC, CDT, EMU, FOLD)
        # U w = p step rounded once (U a power of two: the rounding of w itself, scaled), times
        # the codes: the products w (U code); the zeros' part sum_i w_i (zero_i + U B)
        w = _rnd(p[None, :, :] * _step(vsr)[:, None, :], CDT, EMU)  # (NGP, GH, BLOCK_N)
        zc = tl.reshape(tl.sum(w * (vzr.to(tl.float32) / U + B)[:, None, :], axis=2), (M,))
        wu = _operand(tl.reshape(w, (M, BLOCK_N)), CDT, EMU)
        if TRANS:  # (DV, BLOCK_N) x (BLOCK_N, M): the codes the first operand (see TRANS)
            pv = tl.trans(tl.dot(tl.trans(_operand(vc, CDT, EMU)), tl.trans(wu), input_precision="ieee"))
        else:
            pv = tl.dot(wu, _operand(vc, CDT, EMU), input_precision="ieee")  # (M, DV)
        a_rows = tl.reshape(tl.broadcast_to(alpha[None, :], (NGP, GH)), (M,))
        acc = acc * a_rows[:, None] + pv - zc[:, None]
        m_i = m_new
        if PREFETCH:
            kw, kzr, ksr, vw, vzr, vsr = kw_next, kzr_next, ksr_next, vw_next, vzr_next, vsr_next
    # head h's position p (channel cv[p]) is row (cv[p] // GROUP) GH + h's
    own = tl.arange(0, NGP)[:, None, None] == (cv // GROUP)[None, None, :]
    out = tl.sum(tl.where(own, tl.reshape(acc, (NGP, GH, DV)), 0.0), axis=0)  # (GH, DV)
    part = _store_partials(m_ptr, l_ptr, m_i, l_i, pid, n_splits, split_off, sp, heads, hmask, G, LCOLS)
    tl.store(acc_ptr + part[:, None] * DV + cv[None, :], out, mask=hmask[:, None])


@triton.jit
def _finish(
    q_ptr,
    sq_b,
    sq_h,
    sq_d,
    kn_ptr,
    skn_b,
    skn_h,
    skn_d,
    vn_ptr,
    svn_b,
    svn_h,
    svn_d,
    m_ptr,
    l_ptr,
    acc_ptr,
    score_ptr,
    out_ptr,
    so_b,
    so_h,
    so_d,
    pg_ptr,
    n_splits,
    nt1,
    scale,
    softcap,
    sum_k_ptr,
    sum_v_ptr,
    sum_b_ptr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    DV: tl.constexpr,
    DV_P: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CDT: tl.constexpr,
    EMU: tl.constexpr,
    SUMMARY: tl.constexpr,
    PG: tl.constexpr = True,
):
    """One (sequence, KV head) and BLOCK of its keys, after the split programs: the new key (always
    visible) joins the splits' partials as one more (m = s_new, l = 1, acc = v_new); M = max_j m_j,
    L = sum_j l_j exp(m_j - M); pg_i = sum_h exp(s_hi - M_h) / L_h over this block's keys (the
    last of them the new key); the block-0 program also writes out = sum_j acc_j exp(m_j - M) / L.
    One launch instead of a new-key split, a merge and a probability pass: each program merges
    the few partials itself. ``SUMMARY``: the evicted tokens' mean slot (kvevict.merge; mean key
    and value (b, hkv, d) and log n (b, hkv), contiguous) joins as one more partial, m = s + log n,
    l = 1, acc = its value; it has no pg column. Without ``PG`` (out only: the split programs saved
    no scores) there is one program per (sequence, KV head), and it writes out alone."""
    pid, blk, bi, kh = _program(HKV)
    rows = tl.arange(0, GP)
    rmask = rows < G
    dk = tl.arange(0, D_P)
    dv = tl.arange(0, DV_P)
    # the new key's scores: the scaled query and the key rounded to CDT as the split programs do
    q = _query(q_ptr, sq_b, sq_h, sq_d, bi, kh, rows, dk, rmask[:, None] & (dk[None, :] < D), scale, G, CDT, EMU)
    kn = tl.load(kn_ptr + bi * skn_b + kh * skn_h + dk * skn_d, mask=dk < D, other=0.0).to(tl.float32)
    s_new = tl.sum(q * kn[None, :], axis=1)
    if SOFTCAP:
        s_new = _tanh(s_new / softcap) * softcap
    big_m = s_new  # finite (a padded row's is 0), so no -inf - -inf below
    big_l = tl.full([GP], 1.0, tl.float32)
    if SUMMARY:  # the mean slot: its score plus log n (-inf where nothing was evicted: weight 0)
        ks = tl.load(sum_k_ptr + pid * D + dk, mask=dk < D, other=0.0).to(tl.float32)
        s_sum = tl.sum(q * ks[None, :], axis=1)
        if SOFTCAP:
            s_sum = _tanh(s_sum / softcap) * softcap
        s_sum = s_sum + tl.load(sum_b_ptr + pid)
        m_new = tl.maximum(big_m, s_sum)
        big_l = big_l * tl.exp(big_m - m_new) + tl.exp(s_sum - m_new)
        big_m = m_new
    for j in range(n_splits):
        part = (pid * n_splits + j) * G + rows
        m = tl.load(m_ptr + part, mask=rmask, other=float("-inf"))
        l_j = tl.load(l_ptr + part, mask=rmask, other=0.0)
        m_new = tl.maximum(big_m, m)
        big_l = big_l * tl.exp(big_m - m_new) + l_j * tl.exp(m - m_new)
        big_m = m_new
    if PG:
        keys = blk * BLOCK + tl.arange(0, BLOCK)
        stored = keys < nt1 - 1
        s = tl.load(
            score_ptr + (pid * G + rows[:, None]) * nt1 + keys[None, :],
            mask=rmask[:, None] & stored[None, :],
            other=float("-inf"),
        )
        s = tl.where((keys == nt1 - 1)[None, :], s_new[:, None], s)
        p = tl.where(rmask[:, None], tl.exp(s - big_m[:, None]) / big_l[:, None], 0.0)
        tl.store(pg_ptr + pid * nt1 + keys, tl.sum(p, axis=0), mask=keys < nt1)
    if blk == 0:
        amask = rmask[:, None] & (dv[None, :] < DV)
        vn = tl.load(vn_ptr + bi * svn_b + kh * svn_h + dv * svn_d, mask=dv < DV, other=0.0).to(tl.float32)
        o = tl.exp(s_new - big_m)[:, None] * vn[None, :]
        if SUMMARY:
            vs = tl.load(sum_v_ptr + pid * DV + dv, mask=dv < DV, other=0.0).to(tl.float32)
            o += tl.exp(s_sum - big_m)[:, None] * vs[None, :]
        for j in range(n_splits):
            part = (pid * n_splits + j) * G + rows
            m = tl.load(m_ptr + part, mask=rmask, other=float("-inf"))
            a = tl.load(acc_ptr + part[:, None] * DV + dv[None, :], mask=amask, other=0.0)
            o += a * tl.exp(m - big_m)[:, None]
        o = o / big_l[:, None]
        tl.store(
            out_ptr + bi * so_b + (kh * G + rows[:, None]) * so_h + dv[None, :] * so_d,
            _rnd(o, CDT, EMU).to(CDT),
            mask=amask,
        )
