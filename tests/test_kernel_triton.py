"""The Triton decode-attention backend against plain torch (dequantize, then SDPA / softmax), run on
the CPU in triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported).

Tolerances, absolute: out 2e-5 in fp32 (the kernel and the reference differ only in summation
order: split-K partials against one softmax), 1e-2 in bf16 / fp16 (outputs up to ~3 round to 4e-3
and 5e-4, and the kernel rounds each split's probabilities, the reference the final ones); pg 2e-5
in every dtype: the kernel rounds the scaled query as torch does, and its keys as the reference's
(``make_run``: packed groups of 16+ channels are read factored, from the exact dequantized values,
and the reference takes those; otherwise both round them to the compute dtype), so both take fp32
scores from the same operands."""

import math
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kvevict[triton]')")

from conftest import DEADLINE  # noqa: E402
from kvevict.kernels.triton_decode import _factored, decode_attention_triton, interpreting  # noqa: E402
from kvevict.storage.codes import dequantize, quantize  # noqa: E402

try:
    from kvevict.kernels.runs import Run
except ImportError:  # until kernel-cpu's runs.py is merged: the same fields, per the agreed interface
    from dataclasses import dataclass

    @dataclass
    class Run:
        bits: int
        group: int
        k: tuple
        v: tuple
        n: int


# on the CPU in the interpreter; on a GPU (TRITON_INTERPRET=0 and CUDA) compiled, the same checks
DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = [
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="triton's interpreter is off (TRITON_INTERPRET must be 1 before triton is first "
        "imported; tests/conftest.py sets it) and there is no GPU to compile for",
    ),
    # 3.2 and 3.5 (measured) fail in the interpreter on a loop over runtime bounds with numpy 2
    pytest.mark.skipif(
        DEVICE == "cpu" and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9),
        reason=f"triton {triton.__version__}'s interpreter cannot run the kernel; needs >= 3.9",
    ),
]


def make_run(b, h, n, d, bits, group, dtype, gen, spare=0, factored=True):
    """A run of n slots (viewed out of n + spare stored slots, as a tier hands them over) and its
    keys / values dequantized for the reference, in fp32: as the kernel computes with them, exact
    where it reads them factored (``_factored``), else rounded to ``dtype`` first."""
    k = torch.randn(b, h, n + spare, d, generator=gen) * 2
    v = torch.randn(b, h, n + spare, d, generator=gen)
    if bits in (8, 4, 2):
        kq, vq = quantize(k, bits, group), quantize(v, bits, group)
        run = Run(bits, group, tuple(t.to(DEVICE)[:, :, :n] for t in kq), tuple(t.to(DEVICE)[:, :, :n] for t in vq), n)
        exact = factored and _factored(bits, group, d)
        deq = [
            dequantize(*(t[:, :, :n] for t in x), bits, group, torch.float32 if exact else dtype).float()
            for x in (kq, vq)
        ]
        return run, deq[0], deq[1]
    store = torch.float16 if bits == 16 else dtype
    ks, vs = k.to(store), v.to(store)
    run = Run(bits, group, (ks.to(DEVICE)[:, :, :n],), (vs.to(DEVICE)[:, :, :n],), n)
    return run, ks[:, :, :n].to(dtype).float(), vs[:, :, :n].to(dtype).float()


def on_device(*xs):
    """The case's CPU tensors (None kept) on DEVICE, where its runs are made."""
    return [x.to(DEVICE) if x is not None else None for x in xs]


def call(q, runs, k_new, v_new, mask, *args, **kwargs):
    """The kernel on DEVICE (runs are made there), its results back on the CPU."""
    to = on_device(q, k_new, v_new, mask)
    out, pg = decode_attention_triton(to[0], runs, to[1], to[2], to[3], *args, **kwargs)
    return out.cpu(), None if pg is None else pg.cpu()


def reference(q, keys, values, k_new, v_new, mask, scale, softcap=None):
    """Plain torch over dequantized keys: (out (b, hq, 1, d), pg (b, hkv, n + 1), out via SDPA or None)."""
    b, hq, _, d = q.shape
    hkv = k_new.shape[1]
    g = hq // hkv
    k = [x.expand(-1, hkv, -1, -1) for x in keys] + [k_new.float()]  # a pooled run is seen by every head
    v = [x.expand(-1, hkv, -1, -1) for x in values] + [v_new.float()]
    k, v = torch.cat(k, 2).repeat_interleave(g, 1), torch.cat(v, 2).repeat_interleave(g, 1)
    n = k.shape[2] - 1
    seen = torch.ones(b, hkv, n + 1, dtype=torch.bool)
    if mask is not None:
        seen[..., :n] = mask
    seen = seen.repeat_interleave(g, 1)[:, :, None]
    qs = (q * scale).float()
    s = qs @ k.transpose(-1, -2)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    sdpa = None
    if softcap is None:
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=seen, scale=scale)
    return p @ v, p.view(b, hkv, g, n + 1).sum(2), sdpa


CASES = {  # name: (tiers as (bits, group, n, pooled), d, hkv, g, masked, softcap, dtype)
    "int8-d64-g1": ([(8, 32, 70, False)], 64, 2, 1, True, None, torch.float32),
    "int4-d64-g3": ([(4, 32, 70, False)], 64, 2, 3, True, None, torch.float32),
    "int4-d256-g3": ([(4, 64, 40, False)], 256, 1, 3, True, None, torch.float32),
    "int2-d64-g3": ([(2, 16, 50, False)], 64, 2, 3, False, None, torch.float32),
    # a group across two byte parts (64 > 32 bytes of int4 codes): the kernel's per-channel path
    "int4-group-spans-parts": ([(4, 64, 50, False)], 64, 2, 3, True, None, torch.bfloat16),
    "fp16-d64-g3": ([(16, 32, 50, False)], 64, 2, 3, True, None, torch.float32),
    "dense-d256-g1": ([(32, 32, 40, False)], 256, 2, 1, False, None, torch.float32),
    "dense-group-0": ([(32, 0, 40, False)], 64, 2, 3, False, None, torch.bfloat16),  # group 0: as the cache gives it
    "two-tiers-int8-int4": ([(8, 32, 45, False), (4, 32, 60, False)], 64, 2, 3, True, None, torch.float32),
    "pooled-h1-int4": ([(4, 32, 40, False), (4, 32, 50, True)], 64, 2, 3, True, None, torch.float32),
    "softcap-int4": ([(4, 32, 70, False)], 64, 2, 3, True, 5.0, torch.float32),
    "bf16-int4-two-tiers": ([(16, 32, 30, False), (4, 32, 70, False)], 64, 2, 3, True, None, torch.bfloat16),
    "fp16-int8-pooled": ([(8, 32, 40, True)], 64, 2, 3, True, None, torch.float16),
    # 4 and 2 bits under a half-precision query: codes made from their bits (_unpack's MAGIC)
    "fp16-int4-d128-g4": ([(4, 32, 70, False)], 128, 2, 4, True, None, torch.float16),
    "bf16-int2-pooled": ([(2, 16, 50, False), (2, 32, 40, True)], 64, 2, 3, False, None, torch.bfloat16),
    # 4 groups a token (zeros and steps read as words) and, with 2 heads a group, 8 rows of groups (bytes)
    "bf16-int4-d128-g2": ([(4, 32, 70, False)], 128, 2, 2, True, None, torch.bfloat16),
}


def case_inputs(name, factored=True, b=2):
    """CASES[name] made: (q, runs, keys, values, k_new, v_new, mask, softcap)."""
    tiers, d, hkv, g, masked, softcap, dtype = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    runs, keys, values = [], [], []
    for i, (bits, group, n, pooled) in enumerate(tiers):
        run, k, v = make_run(b, 1 if pooled else hkv, n, d, bits, group, dtype, gen, spare=3 * i, factored=factored)
        runs.append(run)
        keys.append(k)
        values.append(v)
    n_total = sum(r.n for r in runs)
    q = torch.randn(b, hkv * g, 1, d, generator=gen).to(dtype)
    k_new = torch.randn(b, hkv, 1, d, generator=gen).to(dtype)
    v_new = torch.randn(b, hkv, 1, d, generator=gen).to(dtype)
    mask = None
    if masked:  # a pooled tier's mask says which head sees which slot; one sequence sees no stored key
        mask = torch.rand(b, hkv, n_total, generator=gen) > 0.4
        mask[1, 0] = False
    return q, runs, keys, values, k_new, v_new, mask, softcap


@pytest.mark.parametrize(
    "factored, prefetch",
    [(True, True), (False, True), (True, False), (False, False)],
    ids=["factored", "registers", "factored-no-prefetch", "registers-no-prefetch"],
)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch(name, factored, prefetch):
    b, (_, d, hkv, g, _, _, dtype) = 2, CASES[name]
    q, runs, keys, values, k_new, v_new, mask, softcap = case_inputs(name, factored, b)
    n_total = sum(r.n for r in runs)
    scale = d**-0.5
    # split 32 < n: several splits per run, and a run that ends inside a key tile
    out, pg = call(q, runs, k_new, v_new, mask, scale, softcap, split=32, factored=factored, prefetch=prefetch)
    ref_out, ref_pg, sdpa = reference(q, keys, values, k_new, v_new, mask, scale, softcap)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == (b, hkv * g, 1, d)
    assert pg.dtype == torch.float32 and pg.shape == (b, hkv, n_total + 1)
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(pg, ref_pg, atol=2e-5, rtol=0)
    if sdpa is not None:
        torch.testing.assert_close(out.float(), sdpa, atol=tol, rtol=0)
    if mask is not None:  # masked keys get exactly nothing; a fully masked row puts all on the new key
        assert (pg[..., :n_total][~mask.expand(b, hkv, n_total)] == 0).all()
        torch.testing.assert_close(pg[1, 0, -1], torch.tensor(float(g)))


@pytest.mark.parametrize(
    "name", ["int4-d64-g3", "bf16-int4-d128-g2", "two-tiers-int8-int4", "softcap-int4", "dense-d256-g1"]
)
def test_out_only_is_the_same_out(name):
    """pg=False (a policy that collects no statistics): the split programs save no scores and
    _finish runs one program per (sequence, KV head), and out is the same, bit for bit."""
    from kvevict.kernels.triton_decode import plan

    q, runs, _, _, k_new, v_new, mask, softcap = case_inputs(name)
    scale = q.shape[-1] ** -0.5
    out, pg = call(q, runs, k_new, v_new, mask, scale, softcap, split=32)
    only, none = call(q, runs, k_new, v_new, mask, scale, softcap, split=32, pg=False)
    assert none is None and pg is not None
    assert torch.equal(only, out)
    on = on_device(q, k_new, v_new, mask)
    _, probs, launches = plan(on[0], runs, on[1], on[2], on[3], scale, softcap, split=32, pg=False)
    assert probs is None
    assert all(la.kwargs["SCORES"] is False for la in launches[:-1]) and launches[-1].kwargs["PG"] is False
    assert launches[-1].grid == (q.shape[0] * k_new.shape[1], 1)


def test_the_transposed_read_is_sm90s_default(monkeypatch):
    """trans=None: transposed where ``trans_default`` says (an sm_90 GPU), in 128-key tiles only, with
    half as many splits; untransposed elsewhere (here: a CPU tensor) and in the 32-key tiles past head
    dim 128, which were not timed transposed."""
    from kvevict.kernels import triton_config
    from kvevict.kernels.triton_decode import plan

    gen = torch.Generator().manual_seed(0)

    def launched(d, n=4096):  # laid out, not run: a long row is cheap here
        run, _, _ = make_run(1, 2, n, d, 4, 32, torch.bfloat16, gen)
        q, k_new, v_new = on_device(*(torch.randn(1, h, 1, d).bfloat16() for h in (4, 2, 2)))
        _, _, launches = plan(q, [run], k_new, v_new, None, d**-0.5)
        return {la.kwargs["TRANS"] for la in launches if "TRANS" in la.kwargs}, launches[0].grid

    here = {d: launched(d) for d in (128, 256)}
    default = triton_config.trans_default(torch.device(DEVICE))
    assert here[128][0] == {default} and here[256][0] == {False}
    monkeypatch.setattr(triton_config, "trans_default", lambda device: True)
    sm90 = {d: launched(d) for d in here}
    assert sm90[128][0] == {True} and sm90[256] == here[256]
    if not default:  # the transposed read's splits are twice as long: half as many programs
        assert sm90[128][1] == (here[128][1][0], here[128][1][1] // 2)


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize(
    "name", ["bf16-int4-d128-g2", "fp16-int4-d128-g4", "bf16-int2-pooled", "int4-d64-g3", "softcap-int4"]
)
def test_transposed_products_match_torch(name, block):
    """trans=True: both products transposed (the codes the first operand), the keys' words loaded in
    the lanes order where 2 or 4 bits are made from their bits in 64-key tiles: the same attention."""
    _, d, _, _, _, _, dtype = CASES[name]
    q, runs, keys, values, k_new, v_new, mask, softcap = case_inputs(name)
    for prefetch in (True, False):
        out, pg = call(
            q, runs, k_new, v_new, mask, d**-0.5, softcap, split=128, block=block, trans=True, prefetch=prefetch
        )
        ref_out, ref_pg, _ = reference(q, keys, values, k_new, v_new, mask, d**-0.5, softcap)
        torch.testing.assert_close(out.float(), ref_out, atol=2e-5 if dtype == torch.float32 else 1e-2, rtol=0)
        torch.testing.assert_close(pg, ref_pg, atol=2e-5, rtol=0)


@pytest.mark.parametrize("g", [4, 2])
def test_the_factored_reads_switches_give_the_same_attention(g):
    """Codes made from their bits or converted, their bias taken off per code or with the zeros, values
    paired along the channels or the tokens, zeros and steps read as words or bytes, keys per tile:
    the same products of the same exact values, so the same attention (to fp32 summation order)."""
    gen = torch.Generator().manual_seed(g)
    b, hkv, d = 2, 2, 128
    run, _, _ = make_run(b, hkv, 90, d, 4, 32, torch.bfloat16, gen)
    q = torch.randn(b, hkv * g, 1, d, generator=gen).bfloat16()
    kn, vn = torch.randn(2, b, hkv, 1, d, generator=gen).bfloat16()
    mask = torch.rand(b, hkv, 90, generator=gen) > 0.3
    base = call(q, [run], kn, vn, mask, 0.1, magic=False, zwords=False, split=64, block=64)
    for magic, zwords, block, fold, vpairs in (
        (True, False, 64, True, True),
        (False, True, 32, True, True),
        (True, True, 16, True, True),
        (True, True, 32, False, False),
        (True, True, 64, True, False),
        (True, False, 32, False, True),
    ):
        out, pg = call(
            q, [run], kn, vn, mask, 0.1, magic=magic, zwords=zwords, split=64, block=block, fold=fold, vpairs=vpairs
        )
        torch.testing.assert_close(out.float(), base[0].float(), atol=8e-3, rtol=0)  # one bf16 rounding apart
        # a folded bias is carried through fp32 sums as B sum(q) and then taken off: ~1e-6 of a score
        torch.testing.assert_close(pg, base[1], atol=5e-6 if magic and fold else 1e-6, rtol=0)


def test_head_dim_not_power_of_two_and_no_runs():
    gen = torch.Generator().manual_seed(1)
    b, hkv, g, d = 1, 2, 2, 80
    run, k, v = make_run(b, hkv, 33, d, 4, 16, torch.float32, gen)
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    kn, vn = torch.randn(2, b, hkv, 1, d, generator=gen)
    out, pg = call(q, [run], kn, vn, None, 0.1)
    ref_out, ref_pg, _ = reference(q, [k], [v], kn, vn, None, 0.1)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(pg, ref_pg, atol=2e-5, rtol=0)
    out, pg = call(q, [], kn, vn, None, 0.1)  # only the new key: out is its value
    torch.testing.assert_close(out, vn.repeat_interleave(g, 1), atol=1e-6, rtol=0)
    assert (pg == g).all()


def test_bad_input_says_what_to_change():
    gen = torch.Generator().manual_seed(2)
    run, _, _ = make_run(1, 2, 20, 64, 4, 32, torch.float32, gen)
    q, kn, vn = (torch.randn(1, h, 1, 64, device=DEVICE) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="mask must be bool"):
        decode_attention_triton(q, [run], kn, vn, torch.ones(1, 2, 19, dtype=torch.bool, device=DEVICE), 0.1)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        decode_attention_triton(torch.randn(1, 3, 1, 64, device=DEVICE), [run], kn, vn, None, 0.1)
    with pytest.raises(ValueError, match="bits must be one of"):
        decode_attention_triton(q, [Run(3, 32, run.k, run.v, 20)], kn, vn, None, 0.1)
    with pytest.raises(ValueError, match="split must be"):
        decode_attention_triton(q, [run], kn, vn, None, 0.1, split=40)
    with pytest.raises(ValueError, match="block must be a power of two >= 16"):
        decode_attention_triton(q, [run], kn, vn, None, 0.1, block=48)
    with pytest.raises(ValueError, match="warps must be a power of two >= 1"):
        decode_attention_triton(q, [run], kn, vn, None, 0.1, warps=3)
    for regs in (100, 16, 256, True):
        with pytest.raises(ValueError, match="regs must be a multiple of 8 from 24 to 248"):
            decode_attention_triton(q, [run], kn, vn, None, 0.1, regs=regs)
    with pytest.raises(ValueError, match=r"runs\[0\].k tensors must be"):
        decode_attention_triton(q, [Run(4, 32, run.k, run.v, 21)], kn, vn, None, 0.1)
    with pytest.raises(ValueError, match="group=24 must divide"):
        decode_attention_triton(q, [Run(4, 24, run.k, run.v, 20)], kn, vn, None, 0.1)
    # a dtype the kernel has no path for: the dispatcher falls back to the reference
    assert decode_attention_triton(q.double(), [run], kn.double(), vn.double(), None, 0.1) is NotImplemented


def test_register():
    from kvevict.kernels import triton_ops

    registry = {}
    triton_ops.register(registry)
    assert registry == {"triton": triton_ops.decode_attention}


_COMPILE = r"""
import re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvevict.kernels import triton_kernels as tk

def build(fn, const, ptrs):
    # unit channel strides: the JIT specializes ints equal to 1 the same way; constexpr defaults as the JIT's
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const,
             **{n: 1 for n in fn.arg_names if n.endswith("_d") and n.startswith("s")}}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("scale", "softcap") else "i32")
           for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))

bf = "*bf16"
ptrs = dict(q_ptr=bf, kc_ptr="*u8", vc_ptr="*u8", kz_ptr="*u8", ks_ptr="*u8", vz_ptr="*u8", vs_ptr="*u8",
            mask_ptr="*u8", score_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", tab_ptr="*i64")
common = dict(HKV=8, G=4, D=128, DV=128, BITS=4, GROUP=32, BLOCK_N=64, HAS_MASK=True, SOFTCAP=True,
              CDT=tl.bfloat16, EMU=False)
for paged in (False, True):  # storage in rectangles, and in pages read through a table (kvevict.storage.paged)
    k = build(tk._split_kernel, dict(common, GP=16, D_P=128, DV_P=128, GROUPED_K=True, GROUPED_V=True,
              PAGED=paged, PAGE=32, PREFETCH=paged, LOWP=paged), ptrs)
    assert "mma" in k.asm["ptx"], "the scores should run on tensor cores"
    cvts = {}
    for magic in (True, False):
        k = build(tk._split_rows_kernel, dict(common, GH=4, NGP=4, U=16, PAGED=paged, PAGE=32, PREFETCH=paged,
                  MAGIC=magic, ZW=paged, FOLD=magic, VPAIR=magic), dict(ptrs, kc_ptr="*i32", vc_ptr="*i32",  # codes as words
                  **({n: "*i32" for n in ("kz_ptr", "ks_ptr", "vz_ptr", "vs_ptr")} if paged else {})))
        assert "mma" in k.asm["ptx"], "the factored products should run on tensor cores"
        cvts[magic] = len(re.findall(r"cvt\.rn\.(?:bf16|f16|f32)\.[su](?:8|16|32)", k.asm["ptx"]))
    # codes made from their bits: int -> float conversions are left for the zeros alone, not every code
    assert 4 * cvts[True] < cvts[False], cvts
# 32-key tiles (head dims past 128 take them), and the transposed read (trans: warpgroup MMAs on sm_90)
for block_n, trans in ((32, False), (128, True)):
    k = build(tk._split_rows_kernel, dict(common, BLOCK_N=block_n, GH=4, NGP=4, U=16, PAGED=False, PAGE=32,
              PREFETCH=True, MAGIC=True, ZW=False, FOLD=True, VPAIR=True, TRANS=trans, LCOLS=not trans),
              dict(ptrs, kc_ptr="*i32", vc_ptr="*i32"))
    assert ("wgmma" if trans else "mma") in k.asm["ptx"], (block_n, trans)
for summary, pg in ((False, True), (True, True), (True, False)):  # the mean slot (kvevict.merge); out only
    build(tk._finish, dict(HKV=8, G=4, GP=4, D=128, D_P=128, DV=128, DV_P=128, BLOCK=256, SOFTCAP=True,
                           CDT=tl.bfloat16, EMU=False, SUMMARY=summary, PG=pg),
          dict(q_ptr=bf, kn_ptr=bf, vn_ptr=bf, m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", score_ptr="*fp32",
               out_ptr=bf, pg_ptr="*fp32", sum_k_ptr="*fp32", sum_v_ptr="*fp32", sum_b_ptr="*fp32"))
print("compiled")
"""


def test_compiles_for_an_h100_without_one():
    """The compiled path (which the interpreter never takes) builds to an sm_90 binary: triton's
    wheel carries ptxas, so no GPU is needed. In a fresh process, the interpreter off."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(__import__("kvevict").__file__)), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_the_sass_tool_says_what_its_switches_may_be():
    """benchmarks/triton_sass.py refuses an unknown switch or a non-object by name, before compiling."""
    from benchmarks import triton_sass

    for argv, says in (
        (['{"fodl": false}'], "unknown switch(es) fodl: the JSON may name split"),
        (["[1]"], "must be a JSON object"),
        (["{"], "must be a JSON object ("),
    ):
        with pytest.raises(SystemExit, match=re.escape(says)):
            triton_sass.main(argv)


def test_the_sass_counts_show_what_the_switches_save(tmp_path):
    """benchmarks/triton_sass.py compiles the split program for sm_90 here and counts its loop: with
    the bias folded into the zeros no paired subtraction is left (128 a thread a tile without),
    values paired along the tokens plus the fold cost fewer instructions and fewer shared-memory
    operations than neither, and so do the products transposed (the claims of docs/results/performance.md,
    held on the installed triton)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sass.py"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(__import__("kvevict").__file__)), env.get("PYTHONPATH", "")]
    )
    got = {}
    for name, switches in (
        ("on", '{"trans": false}'),
        ("off", '{"fold": false, "vpairs": false, "trans": false}'),
        ("trans", "{}"),
    ):  # sm_90's default, transposed
        out = tmp_path / f"{name}.json"
        done = subprocess.run(
            [sys.executable, str(script), switches, "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        got[name] = json.loads(out.read_text())
    on, off = got["on"], got["off"]
    assert on["classes"]["mma"] == off["classes"]["mma"] > 0  # the same products
    assert on["classes"]["paired half adds"] == 0 < off["classes"]["paired half adds"]
    assert on["loop_instructions"] < off["loop_instructions"]
    assert on["classes"]["shared memory"] < off["classes"]["shared memory"]
    # transposed: warpgroup MMAs of 128 token rows (half as many instructions) and the keys' words
    # loaded where they are multiplied, so fewer instructions and shared-memory operations
    trans = got["trans"]
    assert trans["classes"]["mma"] == on["classes"]["mma"] // 2
    assert trans["loop_instructions"] < on["loop_instructions"]
    assert trans["classes"]["shared memory"] < on["classes"]["shared memory"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the whole cache on a GPU: needs CUDA (compiled triton)")
@pytest.mark.parametrize("kv_bits, paged", [(None, False), (4, False), (4, True), (8, True)])
def test_the_cache_on_a_gpu_generates_as_the_torch_reference(monkeypatch, kv_bits, paged):
    """generate() on CUDA with an evicting cache (H2O, budget below the prompt, two padded rows):
    the triton backend gives the torch reference's greedy tokens, in rectangles and in pages."""
    from conftest import tiny_model
    from kvevict import ATTN_NAME, make_cache
    from kvevict import register as register_attention
    from kvevict.storage import Pools

    model = tiny_model("llama-mha").to("cuda")
    register_attention()
    model.set_attn_implementation(ATTN_NAME)
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (2, 48), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # the second row left-padded
    outs = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setenv("KVEVICT_KERNEL", kernel)
        cache = make_cache(model, "h2o", 24, kv_bits=kv_bits, pages=Pools() if paged else None)
        with torch.no_grad():
            outs[kernel] = model.generate(
                ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False, pad_token_id=0
            ).tolist()
    assert outs["triton"] == outs["torch"]


def test_the_benchmark_configurations_compute_the_same_attention():
    """benchmarks/triton_decode.py times like with like: each configuration (dense, packed in
    rectangles or in shuffled pages, factored or per channel, out only, transposed, the torch copy) gives the attention
    of the same keys, within bf16's rounding of the exact dequantized values."""
    from types import SimpleNamespace

    from benchmarks.triton_decode import TINY, build

    args = SimpleNamespace(
        **TINY,
        group=32,
        split=None,
        page=32,
        splits=[None],
        warps=[None],
        blocks=[None, 16],
        prefetch=[True],
        regs=[None],
        magic=[True, False],
        fold=[True, False],
        vpairs=[True],
        trans=[None, True],
        pg=[True, False],
    )
    configs = build(args, torch.device(DEVICE))
    assert {
        "triton int4",
        "triton int4 registers",
        "triton int4 paged 32",
        "torch int4 (copy)",
        "triton int4 out only",
        "int4 s- w- b- trans",
        "int4 s- w- b- trans out-only",
    } <= set(configs)
    for name, (fn, _, ref) in configs.items():
        if ref is not None:
            out, _ = fn()
            assert (out.float() - ref.float()).abs().max() < 1e-2, name


def test_the_benchmark_says_what_its_sweeps_may_be(capsys):
    """benchmarks/triton_decode.py checks its sweep lists before it looks for triton or a GPU."""
    from benchmarks import triton_decode

    for argv, says in (
        (["--pg", "yes"], "--pg takes comma-separated 1 / 0, got 'yes'"),
        (["--trans", "1,2"], "--trans takes comma-separated 1 / 0, got '2'"),
        (["--splits", "2k"], "--splits takes comma-separated whole numbers, got '2k'"),
    ):
        with pytest.raises(SystemExit):
            triton_decode.main(argv)
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("dtype, softcap", [(torch.float32, None), (torch.bfloat16, 5.0)])
def test_the_merged_caches_mean_slot_joins_as_the_reference_says(dtype, softcap):
    """kvevict.merge: the evicted tokens' mean slot (key, value, log n; -inf for a head that evicted
    nothing) joins _finish as one more partial, as decode_attention_reference joins it; pg keeps
    the stored keys and the new one only."""
    from kvevict.kernels import decode_attention_reference

    gen = torch.Generator().manual_seed(11)
    b, hkv, g, d, n = 2, 2, 3, 64, 70
    run, _, _ = make_run(b, hkv, n, d, 4, 32, dtype, gen)
    q = torch.randn(b, hkv * g, 1, d, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(b, hkv, 1, d, generator=gen).to(dtype) for _ in range(2))
    mk, mv = (torch.randn(b, hkv, 1, d, generator=gen).to(dtype) for _ in range(2))
    logn = torch.tensor([[2.5, -math.inf], [0.0, 5.5]]).view(b, hkv, 1, 1)
    mask = torch.rand(b, hkv, n, generator=gen) > 0.3
    out, pg = call(q, [run], k_new, v_new, mask, d**-0.5, softcap, summary=tuple(x.to(DEVICE) for x in (mk, mv, logn)))
    cpu_run = Run(run.bits, run.group, tuple(t.cpu() for t in run.k), tuple(t.cpu() for t in run.v), n)
    want, want_pg = decode_attention_reference(q, [cpu_run], k_new, v_new, mask, d**-0.5, softcap, (mk, mv, logn))
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference sums in bf16, one ulp at |out| < 4
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=0)
    torch.testing.assert_close(pg, want_pg, atol=2e-5 if dtype == torch.float32 else 2e-3, rtol=0)
    assert pg.shape == (b, hkv, n + 1)
