"""The Triton backend under ``torch.compile`` (kvevict.kernels.triton_ops): each launch sequence is
one custom op whose fake gives its real shapes, a traced call gives the eager call's results, and a
compileable cache's decode step with the triton backend traces whole, records its CUDA graphs once
and writes only static addresses. On the CPU in triton's interpreter (TRITON_INTERPRET=1, set
before triton is first imported); on a GPU with TRITON_INTERPRET=0 the same checks run compiled."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kvevict[triton]')")

from benchmarks.compile_check import CudaGraphRecorder  # noqa: E402

import kvevict  # noqa: E402
from conftest import tiny_model  # noqa: E402
from kvevict.kernels import triton_ops  # noqa: E402
from kvevict.kernels.runs import Run  # noqa: E402
from kvevict.kernels.triton_decode import decode_attention_triton, interpreting  # noqa: E402
from kvevict.kernels.triton_store import dequantize_from_triton, quantize_into_triton, rotate_triton  # noqa: E402
from kvevict.storage.codes import quantize  # noqa: E402
from kvevict.storage.rect import PackedStore  # noqa: E402

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = [
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="triton's interpreter is off (TRITON_INTERPRET must be 1 before triton is first imported) and there is no GPU",
    ),
    pytest.mark.skipif(
        DEVICE == "cpu" and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9),
        reason=f"triton {triton.__version__}'s interpreter cannot run the decode kernel; needs >= 3.9",
    ),
]


def _rand(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).to(DEVICE)


def _decode_args(pg=True, summary=False):
    """A step over a packed int4 run (a view of longer storage) and a dense one, masked."""
    b, hkv, g, d, n4, n16 = 2, 2, 2, 64, 9, 5
    kq, vq = (quantize(_rand(b, hkv, n4 + 3, d, seed=s).cpu(), 4, 32) for s in (1, 2))
    packed = Run(4, 32, *(tuple(t.to(DEVICE)[:, :, :n4] for t in x) for x in (kq, vq)), n4)
    dense = Run(32, 0, (_rand(b, hkv, n16, d, seed=3),), (_rand(b, hkv, n16, d, seed=4),), n16)
    mask = torch.rand(b, hkv, n4 + n16, generator=torch.Generator().manual_seed(5)).to(DEVICE) > 0.3
    mean = (
        (_rand(b, hkv, 1, d, seed=6), _rand(b, hkv, 1, d, seed=7), torch.ones(b, hkv, device=DEVICE))
        if summary
        else None
    )
    q, k_new, v_new = _rand(b, hkv * g, 1, d, seed=8), _rand(b, hkv, 1, d, seed=9), _rand(b, hkv, 1, d, seed=10)
    return (q, [packed, dense], k_new, v_new, mask, d**-0.5, None, mean, pg)


@pytest.mark.parametrize("pg, summary", [(True, False), (False, False), (True, True)])
def test_the_decode_op_traced_is_the_backend_and_its_fake_has_its_shapes(pg, summary):
    q, runs, k_new, v_new, mask, scale, softcap, mean, pg = _decode_args(pg, summary)
    want = decode_attention_triton(q, runs, k_new, v_new, mask, scale, softcap, mean, pg=pg)
    torch._dynamo.reset()
    traced = torch.compile(triton_ops.decode_attention, fullgraph=True, backend="aot_eager")
    got = traced(q, runs, k_new, v_new, mask, scale, softcap, mean, pg)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) if not pg else torch.equal(got[1], want[1])
    tensors = [t for r in runs for t in (*r.k, *r.v)]
    meta = [x for r in runs for x in (r.bits, r.group, r.n, 0)]
    args = (q, k_new, v_new, tensors, meta, [None, None], mask, scale, 0.0, list(mean or ()), pg)
    torch.library.opcheck(torch.ops.kvevict.decode_triton.default, args)


def test_a_traced_call_with_tuning_switches_says_they_are_for_eager_calls():
    args = _decode_args()
    torch._dynamo.reset()
    traced = torch.compile(lambda *a: triton_ops.decode_attention(*a, split=32), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="switches \\(split\\) tune eager calls; a traced step takes the defaults"):
        traced(*args)


def test_the_store_ops_are_the_programs_traced_or_not():
    dtype, bits, group = torch.bfloat16, 4, 32
    x, c = _rand(2, 2, 3, 64, dtype=dtype, seed=11), _rand(2, 2, 64, dtype=torch.float16, seed=12)
    store = PackedStore(2, 2, 6, 64, 64, dtype, DEVICE, bits, group)
    stores = [*store.k.tensors(), *store.v.tensors()]
    idx = torch.tensor([[[4, 0, 2]]], device=DEVICE).expand(2, 2, 3).contiguous()
    take = torch.tensor([True, False, True], device=DEVICE).expand(2, 2, 3).contiguous()
    torch.library.opcheck(torch.ops.kvevict.rotate_triton.default, (x, c))
    torch.library.opcheck(
        torch.ops.kvevict.quantize_into_triton.default, ([t.clone() for t in stores], idx, x, x, bits, group, take)
    )
    want = [t.clone() for t in stores]
    assert quantize_into_triton(want, idx, x, x, bits, group, take) is None
    torch.library.opcheck(torch.ops.kvevict.dequantize_from_triton.default, (want, idx, bits, group, dtype))

    def traced(stores, x, c):
        triton_ops.quantize_into(stores, idx, x, x, bits, group, take)
        return triton_ops.rotate(x, c), *triton_ops.dequantize_from(stores, idx, bits, group, dtype)

    torch._dynamo.reset()
    got = torch.compile(traced, fullgraph=True, backend="aot_eager")(stores, x, c)
    assert all(torch.equal(a, b) for a, b in zip(stores, want))  # written in place, as the program writes
    assert torch.equal(got[0], rotate_triton(x, c))
    assert all(torch.equal(a, b) for a, b in zip(got[1:], dequantize_from_triton(want, idx, bits, group, dtype)))


def _step(model, tok, pos, cache):
    return model(tok, cache=cache, position_ids=pos, use_cache=True).logits


@pytest.mark.parametrize("spec", ["h2o@0.2", "memory=0.2"])
def test_a_compiled_step_on_the_triton_backend_traces_whole_and_records_once(monkeypatch, spec):
    """The decode attention (and, on a GPU, the store programs) is one op in the traced step: no
    graph break, the eager step's logits, no new CUDA graph after the warm-up, no input written in
    place that is not a static address."""
    monkeypatch.setenv("KVEVICT_KERNEL", "triton")
    model = tiny_model("qwen2").to(DEVICE)
    prompt = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits, ops = [], set()
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = kvevict.make_cache(model, spec).compileable(compiled)
        cache.set_prompt_length(prompt.shape[1])
        rec = CudaGraphRecorder()

        def backend(gm, example_inputs, rec=rec):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return rec(gm, example_inputs)

        step = torch.compile(_step, fullgraph=True, backend=backend) if compiled else _step
        with torch.no_grad():
            tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            slack = cache.layers[0].tiers[0].slack
            warm, got = 2 * slack + 1, []
            for i in range(3 * slack + 1):
                before, moves = len(rec.keys), rec.moves
                got.append(step(model, tok, torch.full((2, 1), prompt.shape[1] + i, device=DEVICE), cache))
                tok = got[-1][:, -1:].argmax(-1)
                assert i < warm or len(rec.keys) == before, f"step {i} recorded a new CUDA graph"
                assert i < warm or rec.moves == moves, f"step {i} moved static inputs {sorted(rec.moved)}"
        logits.append(torch.cat(got, 1))
    assert rec.graphs and not rec.mutated
    assert not rec.globals  # no stand-in tensor from a module: on a GPU a CPU one makes CUDA graphs skip the step
    assert any("decode_triton" in op for op in ops), sorted(ops)
    assert torch.equal(logits[0], logits[1])
