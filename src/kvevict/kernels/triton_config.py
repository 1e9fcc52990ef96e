"""How the ``"triton"`` decode backend (``triton_decode``) lays out one step: its keyword switches
(``Switches``, checked), and the ``Config`` that ``configure`` picks from the shapes, the device and
the switches -- keys per tile, keys per split program, the factored read's orientation. Defaults
are what timed best on an H100 (docs/results/performance.md, "On a GPU: the Triton kernel";
docs/results/performance-notes.md, "The Triton kernel's defaults")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Switches:
    """``plan``'s keyword switches, all for tuning on a GPU (``benchmarks/triton_decode.py`` sweeps
    them; the defaults are what was timed best, docs/results/performance.md).

    ``split``: keys per program (a multiple of the key tile; None picks one from the GPU's size);
    ``warps``: warps per split program (None: triton's default); ``block``: keys per tile (a power
    of two >= 16; None: 128 where 2- or 4-bit codes are made from their bits, else 64; 32 past
    head dim 128); ``regs``: registers per thread the split program may use (triton's
    ``maxnreg``; None: the compiler's choice);
    ``factored``: packed runs are read factored where they can be (``_factored``), else every
    channel is dequantized in registers first; ``prefetch``: each tile's bytes are loaded while
    the tile before it is computed; ``lowp``: bf16 queries dequantize in bf16 arithmetic (the
    same single rounding; not in the interpreter, whose bf16 arithmetic is not torch's); ``magic``:
    the factored read turns 2- and 4-bit codes into bf16 / fp16 numbers by their bits
    (``triton_words._unpack``), not by int -> float conversions; ``zwords``: the factored read
    loads a token's zeros and steps as 32-bit words where they fill whole words; ``fold`` (bf16,
    with ``magic``): those numbers keep their bias, taken off with the zeros once per token and
    group (``_split_rows_kernel``'s FOLD); ``vpairs`` (with ``magic``): the values' numbers are
    paired along the tokens, as the value product takes them (``triton_words._unpack_pairs``);
    ``trans``: the factored read's two products transposed, the codes their first operand
    (``_split_rows_kernel``'s TRANS: on an sm_90 GPU warpgroup MMAs, the keys' words loaded where
    they are multiplied); None: on where it was timed faster (``trans_default``), in tiles of 64
    keys or more; ``pg``: pg too (False: out only, no scores saved, one ``_finish`` program per
    sequence and KV head)."""

    split: int | None = None
    warps: int | None = None
    block: int | None = None
    factored: bool = True
    prefetch: bool = True
    lowp: bool = True
    magic: bool = True
    regs: int | None = None
    zwords: bool = True
    fold: bool = True
    vpairs: bool = True
    pg: bool = True
    trans: bool | None = None

    def check(self) -> None:
        """ValueError naming the first switch out of its range: block, warps, regs, split."""
        for name, value, least in (("block", self.block, 16), ("warps", self.warps, 1)):
            if value is not None and (_not_int(value) or value < least or not _pow2_ok(value)):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}.")
        regs = self.regs
        if regs is not None and (_not_int(regs) or not 24 <= regs <= 248 or regs % 8):
            raise ValueError(f"regs must be a multiple of 8 from 24 to 248 (registers per thread), got {regs!r}.")
        split = self.split
        if split is not None and (_not_int(split) or split < 16 or split % 16):
            raise ValueError(f"split must be a positive multiple of 16 (keys per program), got {split!r}.")


@dataclass(frozen=True)
class Config:
    """One decode step's launch configuration, as ``configure`` chose it from the shapes, the device
    and the ``Switches``: what every launch of the step shares."""

    b: int
    hkv: int
    g: int  # query heads per KV head
    d: int
    dv: int
    n_total: int  # stored slots, all runs
    block_n: int  # keys per tile: the per-channel read (``_split_kernel``), and the factored one without magic
    rows_block: int  # keys per tile: the factored read of codes made from their bits
    split: int  # keys per split program
    trans: bool  # the factored read's products transposed
    cdt: object  # q's dtype as triton's: the compute dtype
    emu: bool  # triton's interpreter (a CPU tensor): see _rnd and _operand in triton_softmax
    sw: Switches

    @property
    def gp(self) -> int:
        return max(16, _pow2(self.g))  # tl.dot needs at least 16 rows: the group's heads padded

    @property
    def d_p(self) -> int:
        return max(16, _pow2(self.d))

    @property
    def dv_p(self) -> int:
        return max(16, _pow2(self.dv))


def configure(q, shape: tuple, sw: Switches) -> Config:
    """The ``Config`` of one decode step: q and ``_check``'s shape (b, hq, hkv, d, dv, n_total) under
    the switches ``sw`` (already checked)."""
    from . import triton_kernels as tk  # imports triton

    b, hq, hkv, d, dv, n_total = shape
    widest = max(16, _pow2(d), _pow2(dv))
    # keys per tile, chosen by timing on an H100 (docs/results/performance.md, "On a GPU"): 128 for
    # the factored read of codes made from their bits up to head dim 128, else 64 (the per-channel
    # read spills at 128, int8 is slower), 32 past head dim 128
    block_n = _block(sw.split, sw.block or (64 if widest <= 128 else 32))
    rows_block = _block(sw.split, sw.block or (128 if widest <= 128 else 32))
    trans = sw.trans
    if trans is None:  # timed in 128-key tiles; the 32-key tiles past head dim 128 stay as they were
        trans = trans_default(q.device) and rows_block >= 64
    split = _split(sw.split, max(block_n, rows_block), b * hkv, max(1, n_total), q.device, 2 if trans else 4)
    cdt = {torch.float16: tk.tl.float16, torch.bfloat16: tk.tl.bfloat16, torch.float32: tk.tl.float32}[q.dtype]
    return Config(b, hkv, hq // hkv, d, dv, n_total, block_n, rows_block, split, bool(trans), cdt, not q.is_cuda, sw)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_ok(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _not_int(x) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def _block(split, block_n: int) -> int:
    """Keys per tile: ``block_n``, or the largest power of two >= 16 below it dividing ``split`` (a
    checked one: a multiple of 16)."""
    if split is None:
        return block_n
    while split % block_n:
        block_n //= 2
    return block_n


def trans_default(device) -> bool:
    """Whether ``plan`` transposes the factored read's products when not told: on an sm_90 GPU (the
    H100 / H200), where its warpgroup MMAs timed faster (docs/results/performance-notes.md, "The
    Triton kernel's defaults"); off elsewhere (untimed there) and in the interpreter (a CPU tensor)."""
    return device.type == "cuda" and _gpu(_index(device))[0] == (9, 0)


def _index(device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> tuple:
    """(compute capability, multiprocessors) of CUDA device ``index``, asked once: plan runs every
    layer of every decode step."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def _split(split, block_n: int, programs: int, n_keys: int, device, per_sm: int = 4) -> int:
    """Keys per split: the caller's, or enough splits for ~``per_sm`` programs per multiprocessor
    (on an H100 fewer, longer splits measured faster: 2 or 3 programs fit on one at a time; the
    transposed read, 2: docs/results/performance-notes.md, "The Triton kernel's defaults")."""
    if split is not None:
        return split
    sms = _gpu(_index(device))[1] if device.type == "cuda" else 4
    want = max(1, (per_sm * sms) // max(1, programs))
    return max(4 * block_n, triton_cdiv(triton_cdiv(n_keys, want), block_n) * block_n)
