"""A captured decode step: once the budget is reached, one decode step of a
model with an ``EvictingCache`` (cache update, attention, statistics, eviction) traces under
``torch.compile(fullgraph=True)`` with no graph break, a few graph variants cover the append steps
and the ranking steps, and no step after them recompiles: 4 x slack steps cross several eviction
boundaries. The compiled steps give the eager steps' logits."""

import pytest
import torch
from benchmarks.compile_check import CudaGraphRecorder
from transformers import CompileConfig

import kvevict
from conftest import tiny_model
from kvevict.kernels import cpu

_BUILT = cpu.available()[0]  # a C++ compiler here: kvevict's CPU module built, so inductor's code builds too

# the graph variants a full layer needs: the first ranking, the steps between two rankings (their
# count and the recent tier's width specialised at 0 and 1, then symbolic) and the later rankings
VARIANTS = 6


def _step(model, tok, pos, cache):
    """One decode step, the cache an argument (as generate hands it to its compiled forward)."""
    return model(tok, cache=cache, position_ids=pos, use_cache=True).logits


def _decode(model, spec, prompt, steps, compiled, warm=0):
    """The logits of ``steps`` decode steps after an eager prefill that fills the budget, and the
    cache; compiled: every step under fullgraph, and after ``warm`` steps none recompiles."""
    _reset()
    cache = kvevict.make_cache(model, spec)
    cache.set_prompt_length(prompt.shape[1])
    step = torch.compile(_step, fullgraph=True, backend="eager") if compiled else _step
    logits = []
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        assert all(t.filled == t.budget for layer in cache.layers for t in layer.tiers[:1])
        for i in range(steps):
            pos = torch.full((prompt.shape[0], 1), cache.get_seq_length())
            with torch._dynamo.config.patch(error_on_recompile=compiled and i >= warm):
                logits.append(step(model, tok, pos, cache))
            tok = logits[-1][:, -1:].argmax(-1)
    return torch.cat(logits, 1), cache


def _reset() -> None:
    """No compiled graph and no count left from an earlier test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "spec, prompt_len, dtype",
    [
        ("h2o@0.2", 400, torch.float32),  # 80 tokens, slack 5
        ("snapkv@0.2", 400, torch.float32),
        ("memory=0.2", 400, torch.float32),  # the rule's plan: int8 + int4 tiers
        ("h2o/int4@memory=0.25", 400, torch.bfloat16),  # a recent tier of 16-bit tokens between rankings
        ("ada-snapkv/int4@memory=0.2", 400, torch.float32),  # what Qwen's shipped plan picks: pooled heads, int4
    ],
)
def test_a_full_caches_decode_step_compiles_whole_and_never_recompiles(spec, prompt_len, dtype):
    model = tiny_model("qwen2").to(dtype)
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, prompt_len))
    probe = kvevict.make_cache(model, spec)
    probe.set_prompt_length(prompt_len)
    with torch.no_grad():
        model(prompt, cache=probe, use_cache=True)
    slack = probe.layers[0].tiers[0].slack
    assert slack > 1
    steps = 4 * slack + 1  # rankings at steps 0, s, 2s, 3s and 4s
    eager, _ = _decode(model, spec, prompt, steps, compiled=False)
    # warm-up: the first ranking, a turn-over's steps between rankings, and the second ranking
    compiled, cache = _decode(model, spec, prompt, steps, compiled=True, warm=2 * slack + 1)
    assert _graphs() <= VARIANTS
    assert torch.equal(eager, compiled)
    assert cache.layers[0].seen == prompt_len + steps


def test_generate_compiles_the_decode_step_through_its_compile_config():
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 100))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=21, min_new_tokens=21, do_sample=False)
    cache = kvevict.make_cache(model, "h2o@0.2+slack=4")
    assert not cache.is_compileable  # opt-in: generate never compiles a cache that did not ask
    eager = model.generate(prompt, cache=cache, disable_compile=True, **kw)
    _reset()
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # generate compiles on CUDA by itself; on CPU when asked
    plain = model.generate(prompt, cache=kvevict.make_cache(model, "h2o@0.2+slack=4"), compile_config=config, **kw)
    assert torch.equal(eager, plain) and _graphs() == 0
    cache = kvevict.make_cache(model, "h2o@0.2+slack=4").compileable()
    assert cache.is_compileable
    got = model.generate(prompt, cache=cache, compile_config=config, **kw)
    assert torch.equal(eager, got)
    assert 1 <= _graphs() <= VARIANTS


@pytest.mark.parametrize("spec", ["h2o@0.2", "memory=0.2", "ada-snapkv/int4@memory=0.2", "h2o/int4@memory=0.25"])
def test_a_captured_step_records_its_cuda_graphs_once_and_counts_on_the_device(spec):
    """CUDA graph trees record a graph per distinct tuple of its int inputs, again when a static
    input's storage moved, and skip one that writes in place into a tensor not at a static address:
    after the warm-up no step brings a new int tuple or moves a static input, and every tensor a
    compileable cache's step writes is a static address. The counts the steps advance (on the
    device) read as the eager steps' once read."""
    model = tiny_model("qwen2").to(torch.bfloat16 if "memory=0.25" in spec else torch.float32)
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 400))
    caches = []
    for compiled in (False, True):
        _reset()
        cache = kvevict.make_cache(model, spec).compileable(compiled)
        cache.set_prompt_length(prompt.shape[1])
        rec = CudaGraphRecorder()
        step = torch.compile(_step, fullgraph=True, backend=rec) if compiled else _step
        with torch.no_grad():
            tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            slack = cache.layers[0].tiers[0].slack
            warm, logits = 2 * slack + 1, []
            for i in range(4 * slack + 1):
                before, moves = len(rec.keys), rec.moves
                pos = torch.full((2, 1), prompt.shape[1] + i)  # counted here, as generate counts
                logits.append(step(model, tok, pos, cache))
                tok = logits[-1][:, -1:].argmax(-1)
                assert i < warm or len(rec.keys) == before, f"step {i} recorded a new CUDA graph"
                assert i < warm or rec.moves == moves, f"step {i} moved static inputs {sorted(rec.moved)}"
        caches.append((cache, torch.cat(logits, 1)))
        if compiled:
            assert rec.graphs and not rec.mutated
    (eager, e_logits), (comp, c_logits) = caches
    assert torch.equal(e_logits, c_logits)
    for a, b in zip(eager.layers, comp.layers):
        assert (a.seen, a.evicted, a.get_seq_length()) == (b.seen, b.evicted, b.get_seq_length())
    assert comp.kv_bytes() == eager.kv_bytes()
    with torch.no_grad():  # an eager step after compiled ones folds their counts in
        model(tok, cache=comp, use_cache=True)
    assert comp.layers[0].progress.pending is False and comp.get_seq_length() == eager.get_seq_length() + 1


def test_a_compileable_cache_holds_its_budget_and_wide_positions_only_where_the_model_needs_them():
    """Compileable, a tier holds its budget's slots after the prompt (a captured step never grows
    one), and positions widen to int32 before any captured step only where the model's positions
    can pass int16's 32,767 (the widening waits on a count a captured step cannot read)."""
    model = tiny_model("qwen2")  # 512 positions
    prompt = torch.randint(0, 128, (1, 60))
    for limit, wide in ((None, False), (100_000, True)):
        cache = kvevict.make_cache(model, "memory=0.2")
        if limit is not None:
            cache.max_positions = limit
        cache.compileable()
        cache.set_prompt_length(prompt.shape[1])
        with torch.no_grad():
            model(prompt, cache=cache, use_cache=True)
        tier = cache.layers[0].tiers[0]
        assert tier.capacity == tier.budget > tier.filled  # a short prompt: kept whole, room to its budget
        assert tier.pos_dtype == (torch.int32 if wide else torch.int16)
    plain = kvevict.make_cache(model, "memory=0.2")
    plain.set_prompt_length(prompt.shape[1])
    with torch.no_grad():
        model(prompt, cache=plain, use_cache=True)
    assert plain.layers[0].tiers[0].capacity < plain.layers[0].tiers[0].budget  # not compileable: pages as it grows


@pytest.mark.skipif(not _BUILT, reason="inductor's CPU code needs a C++ compiler, which this machine lacks")
def test_generate_compiles_a_short_prompts_steps_with_inductor_at_two_batch_sizes():
    """A short prompt kept whole grew a page at a time inside the captured steps and read its past
    in spans, one recompile a step (generate stopped at dynamo's limit of 8) and shapes inductor
    failed on once the batch size changed ("Exponent must be non-negative"). A compileable tier now
    holds its budget's slots from the prompt on, and a compiled step reads its past as one piece."""
    model = tiny_model("qwen2")
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    _reset()
    for b in (1, 2):
        torch.manual_seed(b)
        prompt = torch.randint(0, 128, (b, 40))
        kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        eager = model.generate(prompt, cache=kvevict.make_cache(model, "memory=0.2"), disable_compile=True, **kw)
        cache = kvevict.make_cache(model, "memory=0.2").compileable()
        got = model.generate(prompt, cache=cache, compile_config=config, **kw)
        assert torch.equal(eager, got)
