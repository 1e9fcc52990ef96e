"""What the split decode programs share (``triton_split``, ``triton_rows``), and the program that merges
their splits (``_finish``). Imports triton: load it only through ``triton_decode``.

Each program per (sequence, KV head, split) keeps for each query head h of the KV group an online
softmax over the tiles of keys it streams (Milakov & Gimelshein 2018; ``_softmax_start``, ``_online``):

    m_h = max_i s_hi,   l_h = sum_i exp(s_hi - m_h),   acc_h = sum_i exp(s_hi - m_h) v_i

with s_hi = scale * q_h . k_i (fp32 accumulate), softcapped (c * tanh(s / c)) and -inf where
masked, and stores them as the split's partials (``_store_partials``). ``_finish`` adds the new key
and merges the splits: M = max_j m_j, L = sum_j l_j exp(m_j - M), out = sum_j acc_j exp(m_j - M) / L,
and turns the saved scores into pg_i = sum_h exp(s_hi - M_h) / L_h, each key's probability summed
over the group's heads. The rest is the programs' setup (``_program``, ``_at_row``, ``_tile``,
``_query``) and the rounding that holds a kernel to the reference's compute dtype (``_rnd``).
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
