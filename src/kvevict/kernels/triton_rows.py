"""``_split_rows_kernel``: the split decode program for packed runs read factored, the codes
multiplied as they are and only a zero and a step per (token, group) as arithmetic (its docstring
gives the formula). Imports triton: load it only through ``triton_decode``.
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
from .triton_words import _key_words, _per_group, _unpack, _unpack_pairs, _word_order, _word_pairs, _words


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
