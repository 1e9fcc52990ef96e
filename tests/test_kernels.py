"""Fused decode attention over the cache's storage as stored (kvevict.kernels). Every
available backend must equal the torch reference; decoding through the compiled kernel must keep
the same tokens and produce the same text as the torch path."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvevict
from conftest import tiny_model
from kvevict import kernels
from kvevict.kernels import BACKENDS, Run, decode_attention, decode_attention_reference
from kvevict.kernels import cpu as cpu_kernel
from kvevict.storage.codes import quantize

# float32 throughout: the kernel dequantizes with one fma where the reference rounds twice, and
# sums in another order; 1e-5 is ~100 ulps of an output of size ~1
ATOL_OUT, ATOL_PG = 1e-5, 1e-6


def _compiled():
    ok, why = cpu_kernel.available()
    if not ok:
        pytest.skip(f"the compiled CPU kernel cannot be built here ({why})")


def _fused_backends():
    names = []
    for name, b in BACKENDS.items():
        if name != "torch" and b.device in ("cpu", "any") and b.available()[0]:
            names.append(name)
    return names or [pytest.param("cpu", marks=pytest.mark.skip(reason="no compiled backend builds here"))]


def _run(b, h, n, d, bits, group=32, spare=5, seed=0):
    """A run of n slots cut from storage of n + spare slots (a strided view, as a tier hands it)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(b, h, n + spare, d, generator=gen) * 2 for _ in range(2))
    if bits in (32, 16):
        dt = torch.float32 if bits == 32 else torch.float16
        return Run(bits, 0, (k.to(dt)[:, :, :n],), (v.to(dt)[:, :, :n],), n)
    kq, vq = quantize(k, bits, group), quantize(v, bits, group)
    return Run(bits, group, tuple(t[:, :, :n] for t in kq), tuple(t[:, :, :n] for t in vq), n)


def _inputs(b, hkv, g, d, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    k_new, v_new = (torch.randn(b, hkv, 1, d, generator=gen) for _ in range(2))
    return q, k_new, v_new


def _check(backend, q, runs, k_new, v_new, mask, softcap=None):
    scale = q.shape[-1] ** -0.5
    want_out, want_pg = decode_attention_reference(q, runs, k_new, v_new, mask, scale, softcap)
    out, pg = BACKENDS[backend].fn(q, runs, k_new, v_new, mask, scale, softcap)
    assert out.shape == want_out.shape and out.dtype == q.dtype
    assert pg.shape == want_pg.shape == (q.shape[0], k_new.shape[1], sum(r.n for r in runs) + 1)
    torch.testing.assert_close(out, want_out, atol=ATOL_OUT, rtol=1e-5)
    torch.testing.assert_close(pg, want_pg, atol=ATOL_PG, rtol=1e-5)
    # pg is a probability summed over the g heads of each KV group: it sums to g per (sequence, head)
    g = q.shape[1] // k_new.shape[1]
    torch.testing.assert_close(pg.sum(-1), torch.full_like(pg[..., 0], g), atol=1e-4, rtol=0)
    if mask is not None:
        hidden = ~mask.expand(-1, k_new.shape[1], -1)
        assert (pg[..., :-1][hidden] == 0).all()  # a masked key gets exactly nothing


@pytest.mark.parametrize("backend", _fused_backends())
@pytest.mark.parametrize("bits", [8, 4, 2, 16, 32])
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("g", [1, 3])
def test_one_run_with_padding_equals_the_reference(backend, bits, d, g):
    b, hkv, n = 3, 2, 70
    q, k_new, v_new = _inputs(b, hkv, g, d)
    mask = torch.ones(b, 1, n, dtype=torch.bool)
    mask[1, :, :9] = False  # left padding of row 1
    mask[2, :, 40:] = False  # row 2 filled less far
    _check(backend, q, [_run(b, hkv, n, d, bits)], k_new, v_new, mask)
    _check(backend, q, [_run(b, hkv, n, d, bits)], k_new, v_new, None)


@pytest.mark.parametrize("backend", _fused_backends())
@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (32, 4), (16, 8)])
@pytest.mark.parametrize("g", [1, 3])
def test_two_tiers_of_mixed_precision_in_one_pass(backend, bits, g):
    b, hkv, d = 2, 3, 64
    q, k_new, v_new = _inputs(b, hkv, g, d, seed=2)
    runs = [_run(b, hkv, 33, d, bits[0], seed=3), _run(b, hkv, 2100, d, bits[1], seed=4)]  # past one CHUNK
    mask = torch.rand(b, hkv, 2133, generator=torch.Generator().manual_seed(5)) > 0.2
    _check(backend, q, runs, k_new, v_new, mask)


@pytest.mark.parametrize("backend", _fused_backends())
@pytest.mark.parametrize("d", [64, 8])
def test_pooled_runs_with_a_per_head_mask(backend, d):
    """Ada-KV: one pool (h = 1) shared by the KV heads; the mask says whose each slot is."""
    b, hkv, g, n = 2, 3, 3, 90
    q, k_new, v_new = _inputs(b, hkv, g, d, seed=6)
    gen = torch.Generator().manual_seed(7)
    runs = [_run(b, 1, n, d, 4, group=8, seed=8), _run(b, 1, 30, d, 2, group=8, seed=9)]
    whose = torch.randint(0, hkv, (b, 1, n + 30), generator=gen)
    mask = whose == torch.arange(hkv).view(1, -1, 1)
    _check(backend, q, runs, k_new, v_new, mask)


@pytest.mark.parametrize("backend", _fused_backends())
@pytest.mark.parametrize("group", [8, 16, 64])
def test_every_group_size(backend, group):
    """Groups narrower than a vector (8), one vector (16), a whole 64-channel head."""
    b, hkv, g, d = 2, 2, 3, 64
    q, k_new, v_new = _inputs(b, hkv, g, d, seed=12)
    _check(backend, q, [_run(b, hkv, 45, d, 4, group=group), _run(b, hkv, 20, d, 2, group=group)], k_new, v_new, None)


@pytest.mark.parametrize("backend", _fused_backends())
def test_softcap_and_an_empty_run(backend):
    b, hkv, g, d = 2, 2, 3, 64
    q, k_new, v_new = _inputs(b, hkv, g, d, seed=10)
    runs = [_run(b, hkv, 0, d, 4), _run(b, hkv, 50, d, 8)]
    _check(backend, q * 4, runs, k_new, v_new, None, softcap=5.0)


@pytest.mark.parametrize("backend", _fused_backends())
def test_bfloat16_queries_over_bfloat16_storage(backend):
    b, hkv, g, d, n = 2, 2, 3, 64, 40
    q, k_new, v_new = (t.bfloat16() for t in _inputs(b, hkv, g, d, seed=11))
    run = _run(b, hkv, n, d, 32)
    run = Run(32, 0, (run.k[0].bfloat16(),), (run.v[0].bfloat16(),), n)
    want_out, want_pg = decode_attention_reference(q, [run], k_new, v_new, None, d**-0.5)
    out, pg = BACKENDS[backend].fn(q, [run], k_new, v_new, None, d**-0.5, None)
    assert out.dtype == torch.bfloat16
    # the reference rounds the probabilities to bf16 before p . v, the kernel keeps fp32 until the
    # output: it must be at least as close as the reference to the fp32 result (up to an output ulp)
    exact, exact_pg = decode_attention_reference(
        q.float(),
        [Run(32, 0, (run.k[0].float(),), (run.v[0].float(),), n)],
        k_new.float(),
        v_new.float(),
        None,
        d**-0.5,
    )
    assert (out.float() - exact).abs().max() <= (want_out.float() - exact).abs().max() + 1e-2
    torch.testing.assert_close(pg, exact_pg, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("backend", ["torch", *_fused_backends()])
@pytest.mark.parametrize("bits", [4, 32])
def test_out_only_gives_the_same_out_and_no_pg(backend, bits):
    """pg=False, what a policy that collects no statistics asks for: the same out, pg None."""
    b, hkv, g, d = 2, 2, 3, 64
    q, k_new, v_new = _inputs(b, hkv, g, d)
    runs = [_run(b, hkv, 40, d, bits)]
    mask = torch.ones(b, 1, 40, dtype=torch.bool)
    mask[1, :, :7] = False
    out, pg = decode_attention(q, runs, k_new, v_new, mask, d**-0.5, backend=backend)
    only, none = decode_attention(q, runs, k_new, v_new, mask, d**-0.5, backend=backend, pg=False)
    assert none is None and pg is not None
    assert torch.equal(only, out)


def test_a_policy_without_statistics_asks_for_out_only(monkeypatch):
    """Through the public backend registry: recency (no statistics) and knorm (key norms only) ask the
    kernel for out only, H2O for pg; a backend that cannot skip pg (``outonly`` False) is called as
    before and its pg dropped."""
    asked = []

    def spy(*args, **kw):
        asked.append(kw.get("pg", True))
        return decode_attention_reference(*args, **kw)

    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    monkeypatch.setenv("KVEVICT_KERNEL", "spy")
    for outonly in (True, False):
        kernels.register_backend("spy", spy, lambda: (True, ""), "cpu", paged=True, summary=True, outonly=outonly)
        try:
            for policy, want in (("recency", not outonly), ("knorm", not outonly), ("h2o", True)):
                asked.clear()
                cache = kvevict.make_cache(model, policy, budget=8, kv_bits=4, group=8)
                _decode(model, cache, ids, torch.ones_like(ids), steps=2)
                assert asked == [want] * (2 * layers), policy
        finally:
            BACKENDS.pop("spy")


def test_an_unknown_backend_is_a_clear_error(monkeypatch):
    q, k_new, v_new = _inputs(1, 1, 1, 8)
    with pytest.raises(ValueError, match="must be one of"):
        decode_attention(q, [], k_new, v_new, None, 1.0, backend="cuda-magic")
    monkeypatch.setenv("KVEVICT_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVEVICT_KERNEL"):
        decode_attention(q, [], k_new, v_new, None, 1.0)


def test_a_missing_compiled_kernel_falls_back_to_torch_and_says_so_once(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'kvevict_decode': gcc: command not found")

    monkeypatch.setattr(cpu_kernel, "load", no_compiler)
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setenv("KVEVICT_KERNEL", "cpu")
    b, hkv, g, d = 2, 2, 3, 16
    q, k_new, v_new = _inputs(b, hkv, g, d)
    runs = [_run(b, hkv, 20, d, 4, group=8)]
    with caplog.at_level(logging.INFO, logger="kvevict.kernels"):
        for _ in range(3):
            out, pg = decode_attention(q, runs, k_new, v_new, None, d**-0.5)
    want_out, want_pg = decode_attention_reference(q, runs, k_new, v_new, None, d**-0.5)
    assert torch.equal(out, want_out) and torch.equal(pg, want_pg)
    lines = [r for r in caplog.records if r.name == "kvevict.kernels"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "torch reference" in lines[0].message and "gcc: command not found" in lines[0].message


def test_the_chosen_path_is_logged_once(monkeypatch, caplog):
    _compiled()
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.delenv("KVEVICT_KERNEL", raising=False)
    q, k_new, v_new = _inputs(1, 1, 1, 8)
    with caplog.at_level(logging.INFO, logger="kvevict.kernels"):
        for _ in range(3):
            decode_attention(q, [], k_new, v_new, None, 1.0)
    lines = [r.message for r in caplog.records if r.name == "kvevict.kernels"]
    assert lines == ["kvevict decode attention: cpu fused kernel"]


def test_each_environment_builds_into_its_own_folder():
    """Two environments on one machine never share a build folder (each switch rebuilt the other's)."""
    base = dict(
        isa="avx512",
        flags=["-O3"],
        source="// kernel",
        torch_version="2.13.0+cpu",
        torch_path="/env/a/lib/python3.11/site-packages/torch",
        prefix="/env/a",
        python="3.11.7 (main)",
    )
    name = cpu_kernel.build_name(**base)
    assert name.startswith("kvevict_decode_avx512_") and name.isidentifier()  # it names the module too
    assert cpu_kernel.build_name(**base) == name  # the same environment finds its build again
    for key, other in [
        ("torch_version", "2.12.0+cpu"),
        ("torch_path", "/env/b/torch"),
        ("prefix", "/env/b"),
        ("python", "3.12.1 (main)"),
        ("isa", "avx2"),
        ("flags", ["-O2"]),
        ("source", "// kernel 2"),
    ]:
        assert cpu_kernel.build_name(**{**base, key: other}) != name, key


def test_a_failed_build_is_not_tried_again_at_every_step(monkeypatch):
    calls = []

    def no_compiler():
        calls.append(1)
        raise RuntimeError("Error building extension: gcc: command not found")

    monkeypatch.setattr(cpu_kernel, "_compile", no_compiler)
    monkeypatch.setattr(cpu_kernel, "_failure", [])
    cpu_kernel.load.cache_clear()
    try:
        assert [cpu_kernel.available()[0] for _ in range(3)] == [False] * 3
        assert "gcc: command not found" in cpu_kernel.available()[1] and len(calls) == 1
    finally:
        cpu_kernel.load.cache_clear()


def test_the_demo_builds_the_kernel_before_its_timed_runs_or_says_why_not(monkeypatch, capsys):
    from kvevict.commands.demo import build_kernel

    class Model:
        device = torch.device("cpu")

    monkeypatch.delenv("KVEVICT_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setattr(cpu_kernel, "built", lambda: False)
    monkeypatch.setattr(cpu_kernel, "available", lambda: (False, "RuntimeError: gcc: command not found"))
    monkeypatch.setitem(BACKENDS, "cpu", kernels.Backend(BACKENDS["cpu"].fn, cpu_kernel.available, "cpu"))
    build_kernel(Model())  # no compiler: the demo goes on with the torch reference
    out = capsys.readouterr().out
    assert out.startswith("building the CPU decode kernel (once per environment)...")
    assert "gcc: command not found" in out and "torch reference" in out
    monkeypatch.setattr(cpu_kernel, "available", lambda: (True, ""))
    build_kernel(Model())
    assert capsys.readouterr().out.rstrip().endswith(" s")  # "... done in N s"
    monkeypatch.setattr(cpu_kernel, "built", lambda: True)
    build_kernel(Model())
    assert capsys.readouterr().out == ""  # built before: nothing to say


# -- end to end: a tiny random Llama decoding through kvevict caches ------------------------------


def _llama_64():
    """Head dim 64, 3 query heads on 1 KV head (GQA group 3), like SmolLM2's layout."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=192,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def _decode(model, cache, ids, mask, steps):
    """Greedy tokens, the last logits and every tier's kept positions after ``steps`` steps."""
    toks = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache)
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=mask, cache=cache)
    kept = [[torch.where(t.valid, t.pos, -1).sort(-1).values for t in layer.tiers] for layer in cache.layers]
    return torch.cat(toks, 1), out.logits[:, -1], kept


CASES = {
    "int4": dict(policy="h2o", kv_bits=4),
    "int8+int4 tiers": dict(policy="h2o", kv_bits=8, evicted_bits=4, evicted_budget=9),
    "fp32+int2 tiers, roco": dict(policy="roco", evicted_bits=2, evicted_budget=7),
    "ada-kv int4": dict(policy="adakv", kv_bits=4),
    "tova fp16": dict(policy="tova", kv_bits=16),
    "aqas int8": dict(policy="aqas", kv_bits=8),
    "merged, int8+int4 tiers": dict(policy="merge-h2o", kv_bits=8, evicted_bits=4, evicted_budget=9),
    "merged, ada-kv int4": dict(policy="merge-adakv", kv_bits=4),
}


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-64"])
@pytest.mark.parametrize("case", list(CASES))
def test_decoding_through_the_kernel_keeps_what_torch_keeps(monkeypatch, arch, case):
    _compiled()
    model = _llama_64() if arch == "llama-64" else tiny_model("llama-gqa")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (3, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    kw = dict(CASES[case], budget=10, recent=3, group=32 if arch == "llama-64" else 8)  # 32: the vector path
    got = {}
    for backend in ("torch", "cpu"):
        monkeypatch.setenv("KVEVICT_KERNEL", backend)
        got[backend] = _decode(model, kvevict.make_cache(model, **kw), ids, mask, steps=12)
    (t_toks, t_logits, t_kept), (c_toks, c_logits, c_kept) = got["torch"], got["cpu"]
    assert torch.equal(t_toks, c_toks)
    for layer_t, layer_c in zip(t_kept, c_kept):
        for a, b in zip(layer_t, layer_c):
            assert torch.equal(a, b)
    torch.testing.assert_close(c_logits, t_logits, atol=1e-4, rtol=1e-4)


def test_the_kernel_runs_when_decoding(monkeypatch):
    """The fused path is really taken at decode (not silently the torch one)."""
    _compiled()
    calls = []
    real = BACKENDS["cpu"].fn
    monkeypatch.setitem(
        BACKENDS, "cpu", kernels.Backend(lambda *a: calls.append(1) or real(*a), BACKENDS["cpu"].available, "cpu")
    )
    monkeypatch.setenv("KVEVICT_KERNEL", "cpu")
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=8, kv_bits=4, group=8)
    ids = torch.randint(0, 128, (2, 12))
    _decode(model, cache, ids, torch.ones_like(ids), steps=3)
    assert len(calls) == 3 * model.config.num_hidden_layers  # every decode step of every layer
