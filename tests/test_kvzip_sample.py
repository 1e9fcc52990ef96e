"""kvzip-sample: KVzip's reconstruction over a sample of the prompt, the rest by a probe fitted to it."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from eval_helpers import tiny_tokenizer
from kvevict.default_policy import PROBE_POLICY, PROMPT_POLICY, SAMPLE_FROM, SAMPLE_POLICY, pick_policy
from kvevict.policies.kvzip import REPEAT, context_scores
from kvevict.policies.sample import KVzipSample, fitted, reconstructed, starts
from kvevict.probe import EDGES, features, probe_path, save
from kvevict.record import record_attention_stats
from probe_helpers import tiny_probe


def test_the_pieces_are_spread_evenly_over_the_prompt_and_cover_its_share():
    got = starts(1000, 0.25, 32)
    assert len(got) == 8 and got == sorted(got)
    assert all(0 <= s <= 1000 - 32 for s in got)
    gaps = {b - a for a, b in zip(got, got[1:])}
    assert max(gaps) - min(gaps) <= 1  # equal strides (rounding aside)
    whole = starts(1000, 1.0, 32)
    assert whole[0] == 0 and whole[-1] == 1000 - 32
    covered = torch.zeros(1000, dtype=torch.bool)
    for s in whole:
        covered[s : s + 32] = True
    assert bool(covered.all())  # share 1: every key reconstructed
    assert starts(10, 0.25, 32) == [0]  # a prompt shorter than a piece: one piece, all of it


def test_the_sampled_keys_get_the_reconstruction_s_reads_and_the_context_is_left_whole():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    ids = torch.randint(4, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    context = DynamicCache()
    with torch.no_grad():
        model(ids, cache=context, use_cache=True)
    before = [layer.keys.clone() for layer in context.layers]
    got, sampled = reconstructed(model, tok, ids, context, 0.25, 5)
    at = starts(60, 0.25, 5)
    assert int(sampled.sum()) == len(at) * 4  # each piece's keys but its first
    assert context.get_seq_length() == 60 and all(
        torch.equal(a, layer.keys) for a, layer in zip(before, context.layers)
    )
    # the same reads by hand: [repeat, pieces] over a copy of the context
    rep = tok(REPEAT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    seq = torch.cat([rep] + [ids[:, s : s + 5] for s in at], dim=1)
    fresh = DynamicCache()
    with torch.no_grad():
        model(ids, cache=fresh, use_cache=True)
        want = record_attention_stats(model, seq, ("max",), cache=fresh, observe=seq.shape[1])
    for a, st in zip(got, want):
        assert a.shape == (1, 2, 60)
        assert torch.allclose(a, context_scores(st["max"], 60, seq.shape[1]), rtol=1e-4, atol=1e-7)


def test_a_probe_fitted_on_the_sample_ranks_the_keys_outside_it():
    """Scores that are an exact exp-linear map of the keys' features: the fit on a quarter of them
    ranks the other three quarters as the map does, and the sampled keys keep what was measured."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 400, 8, generator=g), torch.randn(1, 2, 400, 8, generator=g)
    x = features(keys, values, EDGES, 400)[0]
    true = (x @ torch.randn(x.shape[1], 2, generator=g) * 0.3).T[None]  # (1, 2, 400) log scores
    sampled = torch.zeros(400, dtype=torch.bool)
    sampled[::4] = True
    measured = torch.where(sampled, true.exp(), torch.zeros(()))
    got = fitted(keys, values, measured, sampled)
    assert torch.equal(got[..., sampled], measured[..., sampled])
    out = ~sampled
    for h in range(2):
        a = got[0, h, out].argsort().argsort().double()
        b = true[0, h, out].argsort().argsort().double()
        rho = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert rho > 0.9, rho
    # a key read by the reconstruction keeps at least that read
    measured2 = measured.clone()
    measured2[..., 1] = 5.0
    assert bool((fitted(keys, values, measured2, sampled)[..., 1] >= 5.0).all())


def test_kvzip_sample_runs_the_prompt_once_then_the_window_and_one_reconstruction():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    ids = torch.randint(4, 128, (1, 80), generator=torch.Generator().manual_seed(2))
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        got = KVzipSample.record(model, tok, ids, window=8, piece=8)
    finally:
        hook.remove()
    assert len(calls) == 3  # the prompt, its last 8 again, [repeat, pieces]
    assert got.scores is not None and len(got.scores) == 3
    assert all(s.shape == (1, 2, 80) and bool((s > 0).all()) for s in got.scores)
    assert got.name == "kvzip-sample" and got.layers and got.adaptive  # kvzip-pool's pooling


def test_kvzip_sample_raises_the_fitted_scores_to_what_the_window_reads():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    ids = torch.randint(4, 128, (1, 64), generator=torch.Generator().manual_seed(6))
    got = KVzipSample.record(model, tok, ids, window=8, piece=8)
    context = DynamicCache()
    with torch.no_grad():
        model(ids[:, :-8], cache=context, use_cache=True)
        seen = record_attention_stats(model, ids[:, -8:], ("max",), cache=context, observe=8)
    measured, sampled = reconstructed(model, tok, ids, context, 0.25, 8)
    assert got.scores is not None
    for a, layer, s, st in zip(got.scores, context.layers, measured, seen):
        want = torch.maximum(fitted(layer.keys, layer.values, s, sampled), st["max"])
        assert torch.allclose(a, want, rtol=1e-3, atol=1e-6)


def test_kvzip_sample_keeps_a_sliding_layer_s_window_only():
    from kvevict.generate import generate
    from test_sliding import W, tiny_gemma3

    model, tok = tiny_gemma3(), tiny_tokenizer()
    prompt = "a sliding window forgets what is far, " * 3
    got = generate(model, tok, prompt, max_new_tokens=4, policy="kvzip-sample", budget=12, window=4, piece=4)
    assert got.new_tokens == 4 and got.kv_bytes < got.model_kv_bytes / 2
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    rec = KVzipSample.record(model, tok, ids, window=4, piece=4)
    assert rec.scores is not None
    for s in rec.scores[:3]:  # the sliding layers: nothing out of the window
        assert bool((s[..., : n - (W - 1)] == 0).all()) and bool((s[..., -(W - 1) :] > 0).all())


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"share": 0.0}, "share"),
        ({"share": 1.5}, "share"),
        ({"share": True}, "share"),
        ({"piece": 1}, "piece"),
        ({"piece": 2.5}, "piece"),
    ],
)
def test_a_bad_share_or_piece_says_what_to_give(bad, says):
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    ids = torch.randint(4, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=says):
        KVzipSample.record(model, tok, ids, **bad)


def test_a_model_without_a_probe_defaults_to_the_sample_from_its_share(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    model = tiny_model("llama-gqa")
    assert pick_policy(True, model=model, share=SAMPLE_FROM) == SAMPLE_POLICY
    assert pick_policy(True, model=model, share=0.5) == SAMPLE_POLICY
    assert pick_policy(True, model=model, share=SAMPLE_FROM / 2) == PROMPT_POLICY  # below: kvzip-pool
    assert pick_policy(True, model=model, share=None) == PROMPT_POLICY  # a budget in bytes
    save(tiny_probe(model), probe_path(model))
    assert pick_policy(True, model=model, share=0.5) == PROBE_POLICY  # a probe of its own first
