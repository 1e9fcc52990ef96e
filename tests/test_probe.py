"""kvevict.probe and kvzip-probe: features rotary embeddings leave unchanged, the ridge fit, the file
a model's probe lives in, and a prompt ranked by the probe from its own prefill."""

import json

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from eval_helpers import tiny_tokenizer
from kvevict.plans import signature
from kvevict.policies.probe import KVzipProbe
from kvevict.probe import EDGES, SINKS, Probe, features, find, fit, load, position_features, probe_path, save
from probe_helpers import tiny_probe


def rotate(x, pos, base=10000.0):
    """Rotary embedding as transformers applies it (pairs j and j + d/2 turned by pos x theta_j)."""
    d = x.shape[-1]
    theta = pos[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def test_features_are_the_same_wherever_rotary_puts_the_key():
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    at = features(rotate(k, torch.arange(5)), v)
    later = features(rotate(k, torch.arange(5) + 1234), v)
    assert at.shape == (1, 5, 2 * 24)
    assert torch.allclose(at, later, atol=1e-5)
    assert not torch.allclose(rotate(k, torch.arange(5)), rotate(k, torch.arange(5) + 1234))  # the keys did move
    assert torch.equal(at[0, :, :16], v[0, 0])  # head 0's values first


def test_the_ridge_fit_recovers_a_linear_map_with_its_bias_unshrunk():
    torch.manual_seed(1)
    x = torch.randn(4000, 6) * torch.tensor([1.0, 5.0, 0.1, 2.0, 1.0, 3.0]) + 7.0
    w = torch.randn(6, 2)
    y = x @ w + torch.tensor([-3.0, 40.0]) + 0.01 * torch.randn(4000, 2)
    (got,) = fit([x], [y], ridge=1e-3)
    assert got.shape == (7, 2)
    assert torch.allclose(got[:-1], w, atol=0.02)
    assert torch.allclose(got[-1], torch.tensor([-3.0, 40.0]), atol=0.2)


def test_a_probe_scores_exp_of_its_linear_map():
    model = tiny_model("llama-gqa")
    probe = tiny_probe(model)
    k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    w = probe.weights[1]
    want = (features(k, v) @ w[:-1] + w[-1]).exp().transpose(1, 2)
    assert torch.allclose(probe.scores(1, k, v), want)
    with pytest.raises(ValueError, match="another model"):
        probe.scores(1, torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16))


def test_kvzip_probe_ranks_from_the_prefill_s_own_cache_in_one_forward():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    probe = tiny_probe(model)
    ids = torch.randint(4, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        got = KVzipProbe.record(model, tok, ids, probe=probe, window=0)
    finally:
        hook.remove()
    assert len(calls) == 1  # the prompt's own forward: no reconstruction pass (and no window here)
    context = DynamicCache()
    model(ids, cache=context, use_cache=True)
    assert got.scores is not None and len(got.scores) == 3
    for i, layer in enumerate(context.layers):
        assert torch.allclose(got.scores[i], probe.scores(i, layer.keys, layer.values), rtol=1e-4)
    # given the caller's prefill it runs nothing
    calls.clear()
    hook = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        again = KVzipProbe.record(model, tok, ids, context=context, probe=probe, window=0)
    finally:
        hook.remove()
    assert not calls and all(torch.allclose(a, b, rtol=1e-4) for a, b in zip(again.scores, got.scores))


def test_a_window_adds_what_the_prompt_s_last_queries_read_most():
    from kvevict.record import record_attention_stats

    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    small = tiny_probe(model, scale=0.05)
    # scores near e**-6, under most attention probabilities: the window's reads show through
    probe = Probe([torch.cat([w[:-1], w[-1:] - 6.0]) for w in small.weights], small.signature)
    ids = torch.randint(4, 128, (1, 48), generator=torch.Generator().manual_seed(4))
    plain = KVzipProbe.record(model, tok, ids, probe=probe)
    context = DynamicCache()
    with torch.no_grad():
        model(ids[:, :-8], cache=context, use_cache=True)
        seen = record_attention_stats(model, ids[:, -8:], ("max",), cache=context, observe=8)
    got = KVzipProbe.record(model, tok, ids, probe=probe, window=8)
    assert got.scores is not None and plain.scores is not None
    for a, p, st in zip(got.scores, plain.scores, seen):
        assert a.shape == p.shape == (1, 2, 48)
        assert torch.allclose(a, torch.maximum(p, st["max"]), rtol=1e-4, atol=1e-6)
    assert any(bool((a > p * 1.01).any()) for a, p in zip(got.scores, plain.scores))  # the window did add
    # given the caller's prefill, it is left holding the whole prompt
    given = DynamicCache()
    model(ids, cache=given, use_cache=True)
    KVzipProbe.record(model, tok, ids, probe=probe, window=8, context=given)
    assert given.get_seq_length() == 48


def test_kvzip_probe_keeps_each_head_s_best_predicted_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    save(tiny_probe(model, scale=1.0), probe_path(model))  # found as the model's own
    ids = torch.randint(4, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    # per head, no window: what is kept is the probe's top 12 of each head
    policy = KVzipProbe.record(model, tok, ids, recent=0, sinks=0, adaptive=False, layers=False)
    cache = kvevict.make_cache(model, policy, budget=12)
    with torch.no_grad():
        model(ids, cache=cache)
    assert policy.scores is not None
    for layer, scores in zip(cache.layers, policy.scores):
        want = scores.topk(12, dim=-1).indices
        assert torch.equal(layer.pos.sort(-1).values, want.sort(-1).values)


def test_without_a_probe_kvzip_probe_says_how_to_fit_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    assert find(model) is None
    with pytest.raises(ValueError, match="kvevict calibrate --probe"):
        KVzipProbe.record(model, tok, torch.randint(4, 128, (1, 20)))


def test_a_probe_file_of_another_model_or_not_a_probe_is_refused(tmp_path):
    model, other = tiny_model("llama-gqa"), tiny_model("llama-mha")
    path = save(tiny_probe(model), tmp_path / "p.json")
    assert torch.allclose(load(path, model).weights[2], tiny_probe(model).weights[2], rtol=1e-5)  # 6 digits kept
    with pytest.raises(ValueError, match="another model"):
        load(path, other)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a kvevict probe"):
        load(tmp_path / "bad.json", model)


def test_the_fit_on_calibration_texts_ranks_its_held_out_texts_as_kvzip_does():
    from kvevict.eval.probe_fit import fit_probe

    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    probe, held = fit_probe(model, tok, tokens=96, texts=3, heldout=1, log=lambda m: None)
    assert probe.edges == EDGES  # a probe fitted now reads where its keys sit
    assert len(probe.weights) == 3 and probe.weights[0].shape == (2 * 12 + len(EDGES) + 1 + 1, 2)
    assert probe.signature == signature(model)
    assert 0.0 < held["spearman"] <= 1.0 and 0.0 < held["top20"] <= 1.0


def test_every_shipped_probe_fits_the_shapes_of_the_model_it_names():
    from kvevict.probe import FORMAT, SHIPPED

    files = sorted(SHIPPED.glob("*.json"))
    assert files  # SmolLM2's at least
    for path in files:
        data = json.loads(path.read_text())
        sig = data["signature"]
        d, hkv = sig["head_dim"] or sig["hidden_size"] // sig["num_attention_heads"], sig["num_key_value_heads"]
        assert data["format"] == FORMAT and len(data["weights"]) == sig["num_hidden_layers"], path.name
        edges = data.get("edges") or []
        for w in data["weights"]:
            assert len(w) == hkv * (d + d // 2) + (len(edges) + 1 if edges else 0) + 1, path.name
            assert all(len(row) == hkv for row in w), path.name


def test_the_prompt_default_is_the_probe_where_the_model_has_one(tmp_path, monkeypatch):
    from kvevict.default_policy import PROMPT_POLICY, pick_policy

    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    model = tiny_model("llama-gqa")
    assert pick_policy(prompt_known=True, model=model, share=0.1) == PROMPT_POLICY
    save(tiny_probe(model), probe_path(model))
    assert pick_policy(prompt_known=True, model=model, share=0.2) == "kvzip-probe"
    assert pick_policy(prompt_known=False, model=model, share=0.2) == "mas"  # streamed text: no prompt to rank


def test_a_key_s_position_is_read_as_its_band_of_distance_from_the_end():
    edges = (0, 8, 64, 512)
    pos = torch.tensor([599, 592, 591, 536, 535, 88, 87, 0, SINKS - 1, SINKS])
    got = position_features(pos, 600, edges)
    band = got[:, :-1].argmax(1).tolist()
    # distances 0, 7 | 8, 63 | 64, 511 | 512, 599 ...: the band each falls in, the last open-ended
    assert band == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3] and bool((got[:, :-1].sum(1) == 1).all())
    assert got[:, -1].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0]  # the first SINKS positions
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    x = features(k, v, edges, total=600)  # a window's 5 keys: the last of 600
    assert x.shape == (1, 5, 2 * 12 + len(edges) + 1)
    assert torch.equal(x[0, :, -len(edges) - 1 :], position_features(torch.arange(595, 600), 600, edges))
    assert torch.equal(x[..., : 2 * 12], features(k, v))  # the rest as before


def test_a_sliding_model_s_probe_reads_the_window_a_stock_cache_kept():
    """Gemma 3's sliding layers hold their window only: the probe scores what they hold by where it
    sits, a key out of the window 0 (as KVzip's), the same as over a cache of every key; a context
    that cannot give back the last ``window`` tokens is refused with what to do."""
    from kvevict.policies.kvzip import past_recorded
    from test_sliding import W, tiny_gemma3

    model, tok = tiny_gemma3(), tiny_tokenizer()
    probe = tiny_probe(model, edges=(0, 2, 4, 6))
    ids = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    whole = KVzipProbe.record(model, tok, ids, probe=probe, window=4)  # its own cache: every key held
    context = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-4], cache=context, use_cache=True)
        with past_recorded(context):
            model(ids[:, -4:], cache=context, use_cache=True)
            got = KVzipProbe.record(model, tok, ids, probe=probe, window=4, context=context)
    assert context.get_seq_length() == 30 and context.layers[0].keys.shape[2] == W - 1  # back to its window
    assert not context.layers[0].record_past
    assert got.scores is not None and whole.scores is not None
    for i, (a, b) in enumerate(zip(got.scores, whole.scores)):
        assert a.shape == b.shape == (1, 1, 30)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), i
    for s in got.scores[:3]:  # the sliding layers: nothing out of the window
        assert bool((s[..., : 30 - (W - 1)] == 0).all()) and bool((s[..., -(W - 1) :] > 0).all())
    assert bool((got.scores[3] > 0).all())  # the global layer scores every key
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=plain, use_cache=True)
    with pytest.raises(ValueError, match="past_recorded"):
        KVzipProbe.record(model, tok, ids, probe=probe, window=4, context=plain)
    assert plain.get_seq_length() == 30 and plain.layers[3].keys.shape[2] == 30  # refused before any crop


def test_generate_on_a_sliding_model_scores_the_probe_over_one_prefill(tmp_path, monkeypatch):
    from kvevict.generate import generate
    from test_sliding import tiny_gemma3

    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    model, tok = tiny_gemma3(), tiny_tokenizer()
    save(tiny_probe(model, edges=(0, 2, 4, 6)), probe_path(model))
    prompt = "a sliding window forgets what is far, " * 2
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        got = generate(model, tok, prompt, max_new_tokens=4, policy="kvzip-probe", budget=12, window=4)
    finally:
        hook.remove()
    # the prompt in two forwards (its last 4 with their past kept), the window again, 4 decode steps
    assert len(calls) == 2 + 1 + 4
    assert got.new_tokens == 4 and got.kv_bytes < got.model_kv_bytes / 2


def test_a_probe_file_whose_bands_are_not_increasing_distances_is_refused(tmp_path):
    model = tiny_model("llama-gqa")
    path = save(tiny_probe(model, edges=(0, 8)), tmp_path / "p.json")
    for bad in ([8, 0], [0, -1], ["0", 8], "0,8"):
        data = json.loads(path.read_text())
        data["edges"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match="edges must be increasing token distances"):
            load(path, model)
