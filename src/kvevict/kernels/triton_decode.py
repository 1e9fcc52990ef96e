"""The ``"triton"`` backend of ``kvevict.kernels.decode_attention``: fused split-K decode attention
(FlashDecoding, Dao et al. 2023) that reads kvevict's stored runs as they are -- packed int8 / int4
/ int2 codes with their step and zero bytes, or dense fp16 / model-dtype keys -- and dequantizes in
registers (x_hat = step * (code - zero / 2^(8 - bits))) or not at all (factored, below), so no
dequantized copy of the cache is ever written.

For one new query per sequence, over the runs in order followed by the new key:

    s_hi = scale * q_h . k_i  (fp32 accumulate; c * tanh(s / c) with a softcap; -inf where masked)
    out_h = sum_i softmax_i(s_h) v_i,    pg_i = sum_{h in the KV group} softmax_i(s_h)

The programs are in ``triton_kernels.py``: per run one launch of a split program (a program per
(sequence, KV head, split of the keys): online-softmax partials and the raw scores) --
``_split_rows_kernel`` for a packed run it can read factored (the codes straight into the tensor
cores, a step and a zero per token and group the only arithmetic: ``_factored``), else
``_split_kernel`` (each channel dequantized in registers) -- then one launch of ``_finish`` (the
new key, the splits merged into out, and pg from the saved scores). ``plan`` lays the launches
out: ``configure`` (``triton_config``) chooses the step's ``Config`` (tile sizes, keys per split, the read), then one
function per kind of launch. Its timings are in docs/results/performance.md ("On a GPU: the Triton
kernel") and docs/results/performance-notes.md. The factored read computes with the exact
dequantized keys and values, where the torch reference (and ``_split_kernel``) rounds them to a
bf16 / fp16 query's dtype first (tests/test_kernel_triton.py holds each path to the keys it uses).

The dispatcher registers it through ``triton_ops.register`` (this module imports without triton,
``available()`` says whether the backend can run), as ``triton_ops.decode_attention``: this
function when eager, one custom op when traced. Runs on CUDA tensors, and on CPU tensors only
under triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first
imported; what the tests use). Returns ``NotImplemented`` (the dispatcher then uses the torch
reference) for CPU tensors outside the interpreter, and for query dtypes other than fp16 / bf16 /
fp32. Bad input raises ValueError (``triton_checks``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import torch

from .triton_checks import _DTYPES, PACKED, _check
from .triton_config import Config, Switches, _pow2, _pow2_ok, configure, triton_cdiv

_FINISH_KEYS = 256  # keys of pg per _finish program


def available() -> tuple[bool, str]:
    """(True, "") when triton imports, else (False, why): what the dispatcher logs on fallback."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton is not installed ({e}); pip install 'kvevict[triton]'"
    return True, ""


def interpreting() -> bool:
    """Whether triton runs its programs in the CPU interpreter: TRITON_INTERPRET=1, and set before
    triton was first imported (its own library functions are interpreted only then)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return False
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl.zeros, InterpretedFunction)


class Launch(NamedTuple):
    """One program launch ``plan`` lays out: ``kernel[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


def decode_attention_triton(q, runs, k_new, v_new, mask, scale, softcap=None, summary=None, pg=True, **switches):
    """The backend: ``plan``'s launches made (its docstring: arguments, switches, results);
    ``NotImplemented`` where triton cannot run these tensors (the dispatcher then uses the torch
    reference)."""
    if not takes(q):
        return NotImplemented
    out, probs, launches = plan(q, runs, k_new, v_new, mask, scale, softcap, summary=summary, pg=pg, **switches)
    for la in launches:
        la.kernel[la.grid](*la.args, **la.kwargs)
    return out, probs


def takes(q) -> bool:
    """Whether the programs run for query ``q``: CUDA (or triton's interpreter) and fp16 / bf16 / fp32.
    ModuleNotFoundError, saying what to install, without triton."""
    ok, why = available()
    if not ok:
        raise ModuleNotFoundError(why)
    return (q.is_cuda or interpreting()) and q.dtype in _DTYPES


def unknown_switches(switches: dict, fixed: tuple = ()) -> str | None:
    """None when every key of ``switches`` is one of ``plan``'s keyword switches (``Switches``'
    fields, less ``fixed``), else a message naming the unknown ones and the known: for tools that
    take switches as JSON."""
    known = [f.name for f in dataclasses.fields(Switches) if f.name not in fixed]
    unknown = sorted(set(switches) - set(known))
    return f"unknown switch(es) {', '.join(unknown)}: the JSON may name {', '.join(known)}." if unknown else None


class Buffers(NamedTuple):
    """What one step's launches write, and the split programs hand ``_finish``."""

    out: torch.Tensor  # (b, hq, 1, dv), q's dtype
    probs: torch.Tensor | None  # pg (b, hkv, n_total + 1) float32; None for out only
    scores: torch.Tensor  # the raw scores (b hkv, g, n_total + 1); without pg a pointer never read
    m_part: torch.Tensor  # each split's partial max (b hkv, splits, g)
    l_part: torch.Tensor  # its normalizer
    acc_part: torch.Tensor  # its weighted values (b hkv, splits, g, dv)

    @property
    def n_splits(self) -> int:
        return self.m_part.shape[1]


def plan(q, runs, k_new, v_new, mask, scale, softcap=None, summary=None, **switches):
    """The launches of one decode step's attention, laid out and not made: (out, pg, [``Launch``]),
    out and pg the buffers they fill (``benchmarks/triton_sass.py`` compiles them for a GPU on any
    machine). q (b, hq, 1, d) unscaled; runs: ``kvevict.kernels.runs.Run`` objects (read by field: bits,
    group, k, v, n); k_new, v_new (b, hkv, 1, d|dv) in q's dtype; mask (b, hkv|1, n_total) bool
    over the stored slots (True = visible) or None; the new key is always visible; ``summary``: a
    merged cache's mean slot (key, value, log n; ``kvevict.merge``), joined by ``_finish``;
    ``switches``: ``Switches``' fields by name (a TypeError for any other).
    Returns (out (b, hq, 1, dv) in q's dtype, pg (b, hkv, n_total + 1) float32); ``pg=False``: out
    only, pg None. One split launch per run that holds slots (``_split_launch``), then one of
    ``_finish`` (``_finish_launch``)."""
    sw = Switches(**switches)
    shape = _check(q, runs, k_new, v_new, mask)
    sw.check()
    cfg = configure(q, shape, sw)
    every = [r for r in runs if r.n > 0]
    splits = [math.ceil(r.n / cfg.split) for r in every]
    bufs = _buffers(q, cfg, sum(splits))
    key_off = split_off = 0
    launches = []
    for run, ns in zip(every, splits):
        launches.append(_split_launch(q, run, mask, bufs, cfg, (key_off, split_off, ns), scale, softcap))
        key_off += run.n
        split_off += ns
    launches.append(_finish_launch(q, k_new, v_new, bufs, cfg, scale, softcap, summary))
    return bufs.out, bufs.probs, launches


def _buffers(q, cfg: Config, n_splits: int) -> Buffers:
    """The step's outputs and the split programs' partials, allocated (not filled)."""
    dev, f32, rows, nt1 = q.device, torch.float32, cfg.b * cfg.hkv, cfg.n_total + 1
    m_part = torch.empty(rows, n_splits, cfg.g, dtype=f32, device=dev)
    scores = torch.empty(rows, cfg.g, nt1, dtype=f32, device=dev) if cfg.sw.pg else m_part  # m_part: never read
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(rows, n_splits, cfg.g, cfg.dv, dtype=f32, device=dev)
    out = torch.empty(cfg.b, cfg.g * cfg.hkv, 1, cfg.dv, dtype=q.dtype, device=dev)
    probs = torch.empty(cfg.b, cfg.hkv, nt1, dtype=f32, device=dev) if cfg.sw.pg else None
    return Buffers(out, probs, scores, m_part, l_part, acc_part)


def _mask_args(mask, dummy) -> tuple:
    """The mask's pointer (bool read as bytes) and (b, h, n) strides, a head stride of 0 for one
    mask shared by the heads; without a mask, ``dummy`` and zero strides."""
    if mask is None:
        return dummy, 0, 0, 0
    m = mask.view(torch.uint8)
    return m, m.stride(0), m.stride(1) if m.shape[1] > 1 else 0, m.stride(2)


def _split_launch(q, run, mask, bufs: Buffers, cfg: Config, place: tuple, scale, softcap) -> Launch:
    """The split programs of one run: a program per (sequence, KV head, split); ``place`` is (the
    run's first key among all runs' keys, its first split among all splits, its splits). The
    factored read (``_factored_read``) where the run allows it, else the per-channel one."""
    from . import triton_kernels as tk

    key_off, split_off, ns = place
    table = getattr(run, "table", None)
    paged = table is not None
    read = _factored_read(q, run, cfg) if cfg.sw.factored else None
    if read is None:
        kernel, kt, vt, extra = tk._split_kernel, run.k, run.v, _channel_kwargs(q, run, cfg)
    else:
        kernel, kt, vt, extra = read
    args = (
        q,
        q.stride(0),
        q.stride(1),
        q.stride(3),
        *_operand(kt, paged),
        *_operand(vt, paged),
        *_mask_args(mask, bufs.scores),
        bufs.scores,
        bufs.m_part,
        bufs.l_part,
        bufs.acc_part,
        run.n,
        key_off,
        split_off,
        cfg.split,
        bufs.n_splits,
        cfg.n_total + 1,
        float(scale),
        float(softcap or 1.0),
        *_table_args(table, kt, vt, bufs.scores),
    )
    kwargs = {**_common_kwargs(run, cfg, paged, mask is not None, softcap is not None), **extra}
    return Launch(kernel, (cfg.b * cfg.hkv, ns), args, kwargs)


def _table_args(table, kt: tuple, vt: tuple, dummy) -> tuple:
    """A paged run's page table (contiguous), its row stride and a page's stride in slots
    (``_page_rows``); without a table, ``dummy`` (a pointer never read) and zeros."""
    if table is None:
        return dummy, 0, 0
    table = table.contiguous()
    return table, table.stride(0), _page_rows(kt, vt)


def _common_kwargs(run, cfg: Config, paged: bool, has_mask: bool, softcap: bool) -> dict:
    """The constants and launch options both split programs take."""
    sw = cfg.sw
    return dict(
        HKV=cfg.hkv,
        G=cfg.g,
        D=cfg.d,
        DV=cfg.dv,
        BITS=run.bits,
        GROUP=run.group if run.bits in PACKED else 1,
        HAS_MASK=has_mask,
        SOFTCAP=softcap,
        CDT=cfg.cdt,
        EMU=cfg.emu,
        PAGED=paged,
        PAGE=getattr(run, "page", 0) if paged else 1,
        PREFETCH=bool(sw.prefetch),
        SCORES=bool(sw.pg),
        **({} if sw.warps is None else {"num_warps": sw.warps}),
        **({} if sw.regs is None or cfg.emu else {"maxnreg": sw.regs}),
    )


def _factored_read(q, run, cfg: Config):
    """(``_split_rows_kernel``, its key and value operands, its constants) for a packed run it can
    read factored (``_factored``: the codes straight into the tensor cores), else None."""
    from . import triton_kernels as tk

    bits, group, d, dv, sw = run.bits, run.group, cfg.d, cfg.dv, cfg.sw
    if not (_factored(bits, group, d) and _factored(bits, group, dv)):
        return None
    gh = _pow2(cfg.g)  # rows of the products: NGP groups x GH heads, at least tl.dot's 16
    ngp = max(_pow2(max(d, dv) // group), -(-16 // gh))
    # zeros and steps as words: a multiple of 4 groups per token, none of the NGP rows padding
    words = _as_words(run.k, run.v, bool(sw.zwords) and d == dv and ngp == d // group and ngp % 4 == 0)
    if not words:
        return None
    (kt, vt), zw = words
    magic = bool(sw.magic) and bits in (2, 4) and q.dtype in (torch.bfloat16, torch.float16)
    kwargs = dict(
        GH=gh,
        NGP=ngp,
        U=1 << (8 - bits),
        BLOCK_N=cfg.rows_block if magic else cfg.block_n,
        ZW=zw,
        MAGIC=magic,
        # fp16's bias (1024, 8x bf16's) would cost pg 8x the cancellation error of bf16's: bf16 only
        FOLD=bool(sw.fold) and q.dtype == torch.bfloat16,
        VPAIR=magic and bool(sw.vpairs),
        TRANS=cfg.trans,
        LCOLS=not cfg.trans,
    )
    return tk._split_rows_kernel, kt, vt, kwargs


def _channel_kwargs(q, run, cfg: Config) -> dict:
    """``_split_kernel``'s constants: every channel dequantized in registers (any run)."""
    return dict(
        GP=cfg.gp,
        D_P=cfg.d_p,
        DV_P=cfg.dv_p,
        BLOCK_N=cfg.block_n,
        GROUPED_K=_grouped(run.bits, run.group, cfg.d),
        GROUPED_V=_grouped(run.bits, run.group, cfg.dv),
        LOWP=bool(cfg.sw.lowp) and q.dtype == torch.bfloat16 and not cfg.emu,
    )


def _finish_launch(q, k_new, v_new, bufs: Buffers, cfg: Config, scale, softcap, summary) -> Launch:
    """``_finish``: per (sequence, KV head) the new key, the mean slot and the splits merged into
    out, and with pg one program per ``_FINISH_KEYS`` keys of pg (else one program)."""
    from . import triton_kernels as tk

    pg, nt1 = bufs.probs is not None, cfg.n_total + 1
    args = (
        q,
        q.stride(0),
        q.stride(1),
        q.stride(3),
        k_new,
        k_new.stride(0),
        k_new.stride(1),
        k_new.stride(3),
        v_new,
        v_new.stride(0),
        v_new.stride(1),
        v_new.stride(3),
        bufs.m_part,
        bufs.l_part,
        bufs.acc_part,
        bufs.scores,
        bufs.out,
        bufs.out.stride(0),
        bufs.out.stride(1),
        bufs.out.stride(3),
        bufs.scores if bufs.probs is None else bufs.probs,
        bufs.n_splits,
        nt1,
        float(scale),
        float(softcap or 1.0),
        *_summary_args(summary, k_new),
    )
    kwargs = dict(
        HKV=cfg.hkv,
        G=cfg.g,
        GP=max(2, _pow2(cfg.g)),
        D=cfg.d,
        D_P=cfg.d_p,
        DV=cfg.dv,
        DV_P=cfg.dv_p,
        BLOCK=_FINISH_KEYS,
        SOFTCAP=softcap is not None,
        CDT=cfg.cdt,
        EMU=cfg.emu,
        SUMMARY=summary is not None,
        PG=pg,
    )
    return Launch(tk._finish, (cfg.b * cfg.hkv, triton_cdiv(nt1, _FINISH_KEYS) if pg else 1), args, kwargs)


def _summary_args(summary, k_new) -> tuple:
    """The mean slot's key, value (b, hkv, d) and log n (b, hkv), contiguous float32 (kvevict.merge);
    without one, stand-ins the kernel never reads."""
    if summary is None:
        return k_new, k_new, k_new
    b, hkv = k_new.shape[:2]
    return tuple(t.reshape(b, hkv, -1).float().contiguous() for t in summary)


def _grouped(bits: int, group: int, d: int) -> bool:
    """Whether a packed tile can be read group by group (``_tile``'s fast path): power-of-two head
    dim and group, each group inside one of the 8 / bits byte parts of a token."""
    return bits in PACKED and _pow2_ok(d) and _pow2_ok(group) and (d * bits // 8) % group == 0


def _factored(bits: int, group: int, d: int) -> bool:
    """Whether a packed operand can be read factored (``triton_rows._split_rows_kernel``): the
    codes go to the tensor cores as they are, only a step and a zero per (token, group) are
    arithmetic, not every channel. Needs a power-of-two head dim and group and whole 32-bit words
    of codes per token."""
    return bits in PACKED and _pow2_ok(d) and _pow2_ok(group) and d % group == 0 and (d * bits) % 32 == 0


def _as_words(kt: tuple, vt: tuple, zw: bool):
    """((kt, vt), zw): their codes viewed as int32 words (no copy), and with ``zw`` their zeros and
    steps too (``triton_words._per_group``'s ZW; False where their strides or offset are not
    whole words); None where the codes cannot be viewed so."""

    def words(t, parts):
        return tuple(x.view(torch.int32) if i in parts else x for i, x in enumerate(t))

    try:
        codes = tuple(words(t, (0,)) for t in (kt, vt))
    except RuntimeError:
        return None
    if zw:
        try:
            return tuple(words(t, (1, 2)) for t in codes), True
        except RuntimeError:
            pass
    return codes, False


def _operand(t: tuple, paged: bool = False) -> tuple:
    """(codes, zeros, steps) pointers then their (b, h, n, d) strides; a head stride of 0 for a pooled
    (one-head) run; dense runs pass their keys three times (zeros and steps are never read). Paged
    (pools (pages, h, page, d)): no batch stride, the kernel finds a row's slots through its table."""
    ts = t if len(t) == 3 else (t[0], t[0], t[0])
    strides = []
    for x in ts:
        strides += [0 if paged else x.stride(0), x.stride(1) if x.shape[1] > 1 else 0, x.stride(2), x.stride(3)]
    return (*ts, *strides)


def _page_rows(kt: tuple, vt: tuple) -> int:
    """A page's stride in slot strides, the same for every pool of a paged run (each is (pages, h,
    page, width), contiguous): the kernel turns (page, slot) into one row index with it."""
    got = {x.stride(0) // x.stride(2) for x in (*kt, *vt)}
    if len(got) != 1 or any(x.stride(0) % x.stride(2) for x in (*kt, *vt)):
        raise ValueError("a paged run's pools must be contiguous (pages, heads, page, width) tensors.")
    return got.pop()
