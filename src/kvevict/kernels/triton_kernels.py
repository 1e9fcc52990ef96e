"""The Triton programs behind ``kvevict.kernels.triton_decode`` (imports triton: load it only
through ``triton_decode``, which checks that triton is there first).

Split-K decode attention (FlashDecoding, Dao et al. 2023): keys are cut into splits; one program
per (sequence, KV head, split) streams its keys in tiles of BLOCK_N, dequantizes them in registers
(x_hat = step * (code - zero / 2^(8 - bits)), ``kvevict.store.quantize``), and keeps for each query head h of the
KV group an online softmax (Milakov & Gimelshein 2018):

    m_h = max_i s_hi,   l_h = sum_i exp(s_hi - m_h),   acc_h = sum_i exp(s_hi - m_h) v_i

with s_hi = scale * q_h . k_i (fp32 accumulate), softcapped (c * tanh(s / c)) and -inf where
masked. ``_combine`` merges the splits: M = max_j m_j, L = sum_j l_j exp(m_j - M),
out = sum_j acc_j exp(m_j - M) / L. ``_group_probs`` then turns the saved scores into
pg_i = sum_h exp(s_hi - M_h) / L_h, each key's probability summed over the group's heads.
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
    """Step bytes -> fp32 steps (``kvevict.store.step_value``; 16 is ``kvevict.store.STEP_BIAS``)."""
    return ((u.to(tl.int32) << 20) + ((127 - 16) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _tile(c_ptr, z_ptr, s_ptr, sc_n, sc_d, sz_n, sz_d, ss_n, ss_d, rows, nm, cols,
          BITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CDT: tl.constexpr, EMU: tl.constexpr,
          GROUPED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_N, D_P) keys or values rounded to the compute dtype CDT (held in fp32). Packed: channel
    c of a token sits in byte c % W at bit (c // W) * BITS, W = D * BITS / 8 (``kvevict.store.pack``);
    its group is c // GROUP; x_hat = (step / U) * (U code - zero), U = 2^(8 - BITS), exact before the
    one rounding to CDT that ``kvevict.store.dequantize`` makes too, so both backends see the same keys.
    GROUPED (D a power of two and each group inside one W-byte part): the tile is read as
    (BLOCK_N, groups, GROUP), so a group's bytes load as one contiguous vector and its zero and step
    once, not once per channel; otherwise per channel."""
    valid = nm[:, None] & (cols[None, :] < D)  # rows in the run, channels of the (padded) head dim
    if BITS >= 16:
        x = tl.load(c_ptr + rows[:, None] * sc_n + cols[None, :] * sc_d, mask=valid, other=0.0)
        x = _rnd(x.to(tl.float32), CDT, EMU)
    elif GROUPED:
        U: tl.constexpr = 1 << (8 - BITS)  # zero units per step
        NG: tl.constexpr = D // GROUP
        PART: tl.constexpr = D * BITS // 8 // GROUP  # groups per W-byte part
        gi = tl.arange(0, NG)
        byte = (gi % PART)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (NG, GROUP)
        shift = ((gi // PART) * BITS)[:, None]
        raw = tl.load(c_ptr + rows[:, None, None] * sc_n + byte[None, :, :] * sc_d, mask=nm[:, None, None],
                      other=0).to(tl.int32)
        code = (raw >> shift[None, :, :]) & ((1 << BITS) - 1)
        z = tl.load(z_ptr + rows[:, None] * sz_n + gi[None, :] * sz_d, mask=nm[:, None], other=0).to(tl.int32)
        s = _step(tl.load(s_ptr + rows[:, None] * ss_n + gi[None, :] * ss_d, mask=nm[:, None], other=0))
        x = _rnd((code * U - z[:, :, None]).to(tl.float32) * (s / U)[:, :, None], CDT, EMU)
        x = tl.reshape(x, (BLOCK_N, D))
    else:
        U: tl.constexpr = 1 << (8 - BITS)
        W: tl.constexpr = D * BITS // 8
        byte = cols % W
        shift = (cols // W) * BITS
        raw = tl.load(c_ptr + rows[:, None] * sc_n + byte[None, :] * sc_d, mask=valid, other=0).to(tl.int32)
        code = (raw >> shift[None, :]) & ((1 << BITS) - 1)
        gi = cols // GROUP
        z = tl.load(z_ptr + rows[:, None] * sz_n + gi[None, :] * sz_d, mask=valid, other=0).to(tl.int32)
        s = _step(tl.load(s_ptr + rows[:, None] * ss_n + gi[None, :] * ss_d, mask=valid, other=0))
        # (U code - zero) * (step / U) is exact in fp32; rounded to CDT once, where torch rounds
        x = _rnd((code * U - z).to(tl.float32) * (s / U), CDT, EMU)
    return x


@triton.jit
def _split_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    kc_ptr, kz_ptr, ks_ptr,
    skc_b, skc_h, skc_n, skc_d, skz_b, skz_h, skz_n, skz_d, sks_b, sks_h, sks_n, sks_d,
    vc_ptr, vz_ptr, vs_ptr,
    svc_b, svc_h, svc_n, svc_d, svz_b, svz_h, svz_n, svz_d, svs_b, svs_h, svs_n, svs_d,
    mask_ptr, sm_b, sm_h, sm_n,
    score_ptr, m_ptr, l_ptr, acc_ptr,
    n, key_off, split_off, split, n_splits, nt1, scale, softcap,
    tab_ptr, tab_b, page_rows,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, CDT: tl.constexpr, EMU: tl.constexpr,
    GROUPED_K: tl.constexpr, GROUPED_V: tl.constexpr, PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1,
):
    """One (sequence, KV head, split) of one run: partial m, l, acc and the raw scores. The scaled
    query, the keys, the values and the probabilities are rounded to the compute dtype CDT where
    the torch reference holds them in it; products accumulate in fp32."""
    pid = tl.program_id(0).to(tl.int64)  # offsets of big batches overflow int32
    sp = tl.program_id(1)
    bi = pid // HKV
    kh = pid % HKV
    rows = tl.arange(0, GP)
    rmask = rows < G
    dk = tl.arange(0, D_P)
    dv = tl.arange(0, DV_P)
    # the query rows of this KV group, scaled in the compute dtype as the reference does
    q = tl.load(q_ptr + bi * sq_b + (kh * G + rows[:, None]) * sq_h + dk[None, :] * sq_d,
                mask=rmask[:, None] & (dk[None, :] < D), other=0.0)
    q = _operand(_rnd(q.to(tl.float32) * scale, CDT, EMU), CDT, EMU)
    # a pooled run (one head) arrives with head strides 0
    kc_ptr += bi * skc_b + kh * skc_h
    kz_ptr += bi * skz_b + kh * skz_h
    ks_ptr += bi * sks_b + kh * sks_h
    vc_ptr += bi * svc_b + kh * svc_h
    vz_ptr += bi * svz_b + kh * svz_h
    vs_ptr += bi * svs_b + kh * svs_h
    start = sp * split
    end = tl.minimum(start + split, n)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV_P], tl.float32)
    for t in range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        nm = offs < end
        slots = offs
        if PAGED:  # slot i of row bi: slot i % PAGE of page tab[bi, i // PAGE], in slot-stride units
            pg = tl.load(tab_ptr + bi * tab_b + offs // PAGE, mask=nm, other=0)
            slots = pg * page_rows + offs % PAGE
        k = _tile(kc_ptr, kz_ptr, ks_ptr, skc_n, skc_d, skz_n, skz_d, sks_n, sks_d, slots, nm, dk,
                  BITS, GROUP, D, CDT, EMU, GROUPED_K, BLOCK_N)
        s = tl.dot(q, tl.trans(_operand(k, CDT, EMU)), input_precision="ieee")  # (GP, BLOCK_N), fp32
        if SOFTCAP:
            s = _tanh(s / softcap) * softcap
        visible = nm
        if HAS_MASK:
            seen = tl.load(mask_ptr + bi * sm_b + kh * sm_h + (key_off + offs) * sm_n, mask=nm, other=0)
            visible = visible & (seen != 0)
        s = tl.where(visible[None, :], s, float("-inf"))
        tl.store(score_ptr + ((pid * G + rows[:, None]) * nt1 + key_off + offs[None, :]), s,
                 mask=rmask[:, None] & nm[None, :])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _tile(vc_ptr, vz_ptr, vs_ptr, svc_n, svc_d, svz_n, svz_d, svs_n, svs_d, slots, nm, dv,
                  BITS, GROUP, DV, CDT, EMU, GROUPED_V, BLOCK_N)
        pv = tl.dot(_operand(_rnd(p, CDT, EMU), CDT, EMU), _operand(v, CDT, EMU), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    part = (pid * n_splits + split_off + sp) * G + rows
    tl.store(m_ptr + part, m_i, mask=rmask)
    tl.store(l_ptr + part, l_i, mask=rmask)
    tl.store(acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=rmask[:, None] & (dv[None, :] < DV))


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h, so_d, mfin_ptr, lfin_ptr, n_splits,
             HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
             CDT: tl.constexpr, EMU: tl.constexpr):
    """One (sequence, KV head): merge the splits' partials; write out and the final M, L."""
    pid = tl.program_id(0).to(tl.int64)  # offsets of big batches overflow int32
    bi = pid // HKV
    kh = pid % HKV
    rows = tl.arange(0, GP)
    rmask = rows < G
    dv = tl.arange(0, DV_P)
    amask = rmask[:, None] & (dv[None, :] < DV)
    big_m = tl.full([GP], float("-inf"), tl.float32)
    big_l = tl.zeros([GP], tl.float32)
    o = tl.zeros([GP, DV_P], tl.float32)
    for j in range(n_splits):
        part = (pid * n_splits + j) * G + rows
        m = tl.load(m_ptr + part, mask=rmask, other=float("-inf"))
        l_j = tl.load(l_ptr + part, mask=rmask, other=0.0)
        a = tl.load(acc_ptr + part[:, None] * DV + dv[None, :], mask=amask, other=0.0)
        m_new = tl.maximum(big_m, m)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(big_m - m_ref)
        w = tl.exp(m - m_ref)
        big_l = big_l * alpha + l_j * w
        o = o * alpha[:, None] + a * w[:, None]
        big_m = m_new
    o = o / tl.where(big_l > 0, big_l, 1.0)[:, None]
    tl.store(out_ptr + bi * so_b + (kh * G + rows[:, None]) * so_h + dv[None, :] * so_d,
             _rnd(o, CDT, EMU).to(CDT), mask=amask)
    tl.store(mfin_ptr + pid * G + rows, big_m, mask=rmask)
    tl.store(lfin_ptr + pid * G + rows, big_l, mask=rmask)


@triton.jit
def _group_probs(score_ptr, mfin_ptr, lfin_ptr, pg_ptr, nt1,
                 G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    """pg_i = sum_h exp(s_hi - M_h) / L_h over the KV group's query heads, for BLOCK keys."""
    pid = tl.program_id(0).to(tl.int64)  # offsets of big batches overflow int32
    blk = tl.program_id(1)
    rows = tl.arange(0, GP)
    rmask = rows < G
    keys = blk * BLOCK + tl.arange(0, BLOCK)
    kmask = keys < nt1
    s = tl.load(score_ptr + (pid * G + rows[:, None]) * nt1 + keys[None, :],
                mask=rmask[:, None] & kmask[None, :], other=float("-inf"))
    big_m = tl.load(mfin_ptr + pid * G + rows, mask=rmask, other=0.0)
    big_l = tl.load(lfin_ptr + pid * G + rows, mask=rmask, other=1.0)
    p = tl.exp(s - big_m[:, None]) / big_l[:, None]
    tl.store(pg_ptr + pid * nt1 + keys, tl.sum(p, axis=0), mask=kmask)
