"""Reading packed codes as 32-bit words for the factored split program (``triton_rows``): the
order a token's channels are held in (``_word_order``), the words' loads and their unpacking into
small integers held exactly in a float dtype (``_unpack``, ``_unpack_pairs``), and a token's
group-wise zeros and steps (``_per_group``). Imports triton: load it only through ``triton_decode``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_softmax import _slots


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
