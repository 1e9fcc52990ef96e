"""merge: the evicted tokens kept as one mean slot per (row, KV head) (kvevict.merge)."""

import math

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.attention import attend, generic_segments
from kvevict.policies import make_policy


def _run(model, ids, cache, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, cache=cache).logits


def test_the_name_and_the_flag():
    assert make_policy("merge-h2o").merge and not make_policy("h2o").merge
    p = make_policy("merge-ada-h2o")
    assert p.merge and p.adaptive
    with pytest.raises(ValueError, match="merge-NAME"):
        make_policy("merge-nonesuch")


def test_a_covering_budget_is_still_exact():
    model = tiny_model("llama-gqa")
    torch.manual_seed(1)
    prompt, steps = torch.randint(0, 128, (2, 24)), torch.randint(0, 128, (2, 5))
    ref_cache, cache = DynamicCache(config=model.config), kvevict.make_cache(model, "merge-h2o", budget=30)
    for ids in [prompt] + [steps[:, i : i + 1] for i in range(steps.shape[1])]:
        assert (_run(model, ids, ref_cache) - _run(model, ids, cache)).abs().max().item() < 1e-4
    assert all(float(layer.summary.n.sum()) == 0 for layer in cache.layers)


def test_one_mean_slot_attends_as_n_copies_of_the_mean():
    """The formula: a summary of n tokens with mean key k and value v gives the output and the kept
    keys' probabilities that n stored copies of (k, v) give."""
    torch.manual_seed(0)
    b, hkv, g, d, n_kept, n = 2, 2, 3, 16, 7, 5
    q = torch.randn(b, hkv * g, 1, d)
    keys, values = torch.randn(b, hkv, n_kept + 1, d), torch.randn(b, hkv, n_kept + 1, d)
    mk, mv = torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
    copies_k = torch.cat([keys[:, :, :n_kept], mk.expand(-1, -1, n, -1), keys[:, :, n_kept:]], dim=2)
    copies_v = torch.cat([values[:, :, :n_kept], mv.expand(-1, -1, n, -1), values[:, :, n_kept:]], dim=2)
    want, want_stats = attend(q, generic_segments(copies_k, copies_v, 1, None), d**-0.5, None, None, ("sum",))
    seg = generic_segments(keys, values, 1, None)
    seg.summary = (mk, mv, torch.full((b, hkv, 1, 1), math.log(n)))
    got, stats = attend(q, seg, d**-0.5, None, None, ("sum",))
    assert (got - want).abs().max().item() < 1e-5
    assert torch.allclose(stats["sum"][..., :n_kept], want_stats["sum"][..., :n_kept], atol=1e-6)
    assert torch.allclose(stats["sum"][..., -1], want_stats["sum"][..., -1], atol=1e-6)  # the new key
    seg.summary = (mk, mv, torch.full((b, hkv, 1, 1), -math.inf))  # nothing evicted: no column at all
    plain, _ = attend(q, generic_segments(keys, values, 1, None), d**-0.5, None, None, ("sum",))
    assert (attend(q, seg, d**-0.5, None, None, ("sum",))[0] - plain).abs().max().item() < 1e-6


@pytest.mark.parametrize("policy", ["merge-h2o", "merge-ada-h2o"])
def test_the_summary_holds_exactly_what_prefill_evicted(policy):
    """After a whole prompt enters (attention over all of it, then the budget kept), each head's
    summary holds the sum of the keys and values it evicted: the stock cache's sums less what the
    layer keeps, and their count; Ada-KV's pooled heads each theirs."""
    model = tiny_model("llama-gqa")
    torch.manual_seed(3)
    prompt, budget = torch.randint(0, 128, (2, 20)), 8
    stock = DynamicCache(config=model.config)
    _run(model, prompt, stock)
    cache = kvevict.make_cache(model, policy, budget=budget, recent=2)
    _run(model, prompt, cache)
    for layer, ref in zip(cache.layers, stock.layers):
        t = layer.tiers[0]
        keep = t.valid[..., : t.filled].float()  # (b, 1 or h, slots)
        k, v = t.store.keys[:, :, : t.filled], t.store.values[:, :, : t.filled]
        if layer.shared > 1:  # one pool: each slot counted for its own head
            heads = torch.nn.functional.one_hot(t.head[:, 0, : t.filled].long(), layer.shared).float()  # (b, n, h)
            kept_k = torch.einsum("bnh,bnd->bhd", heads * keep[:, 0, :, None], k[:, 0])
            kept_v = torch.einsum("bnh,bnd->bhd", heads * keep[:, 0, :, None], v[:, 0])
            kept_n = (heads * keep[:, 0, :, None]).sum(1)
        else:
            kept_k, kept_v, kept_n = (k * keep[..., None]).sum(2), (v * keep[..., None]).sum(2), keep.sum(2)
        assert torch.allclose(layer.summary.k, ref.keys.sum(2) - kept_k, atol=1e-4)
        assert torch.allclose(layer.summary.v, ref.values.sum(2) - kept_v, atol=1e-4)
        assert torch.equal(layer.summary.n, prompt.shape[1] - kept_n)
    assert int(cache.layers[0].summary.n.sum()) == 2 * 2 * (20 - budget)  # rows x KV heads x evicted


def test_decoding_counts_every_token_once_padding_none():
    """Left-padded rows: the summary counts real tokens only, and kept + merged = every real token
    a row has seen, each step; the bytes include the summary's."""
    model = tiny_model("llama-gqa")
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1: 11 real tokens
    cache = kvevict.make_cache(model, "merge-h2o", budget=6, recent=2)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == 22
    for layer in cache.layers:
        t = layer.tiers[0]
        kept = (t.pos[..., : t.filled] >= 0).sum(-1)  # (b, h)
        seen = torch.tensor([16 + 5, 11 + 5]).view(2, 1)  # the last new token is never fed
        assert torch.equal(layer.summary.n.long() + kept, seen.expand_as(kept))
    plain = kvevict.make_cache(model, "h2o", budget=6, recent=2)
    model.generate(ids, attention_mask=mask, cache=plain, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    d = model.config.hidden_size // model.config.num_attention_heads
    per_layer = 2 * 2 * (2 * d + 1) * 4  # rows x KV heads x (key + value sums, count) x fp32
    assert cache.kv_bytes() - plain.kv_bytes() == per_layer * len(cache.layers)


def test_merging_changes_what_eviction_answers_and_two_tiers_merge_what_leaves_the_second():
    model = tiny_model("llama-gqa")
    torch.manual_seed(5)
    prompt = torch.randint(0, 128, (1, 24))
    gen = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    kept = _run(model, prompt, kvevict.make_cache(model, "h2o", budget=6))
    merged = _run(model, prompt, kvevict.make_cache(model, "merge-h2o", budget=6))
    assert torch.equal(kept, merged)  # prefill attends over the whole prompt either way
    a, b = kvevict.make_cache(model, "h2o", budget=6), kvevict.make_cache(model, "merge-h2o", budget=6)
    model.generate(prompt, cache=a, **gen)
    model.generate(prompt, cache=b, **gen)
    la, lb = _run(model, prompt[:, :1], a), _run(model, prompt[:, :1], b)
    assert (la - lb).abs().max().item() > 1e-3  # the summary is read while decoding
    two = kvevict.make_cache(model, "merge-h2o", budget=6, kv_bits=8, evicted_bits=4, evicted_budget=6)
    model.generate(prompt, cache=two, **gen)
    for layer in two.layers:  # 24 + 7 tokens, 6 + 6 kept in the two tiers: 19 merged per head
        assert torch.equal(layer.summary.n, torch.full_like(layer.summary.n, 24 + 7 - 12))


def test_compact_positions_refuse_merge():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "merge-h2o", budget=6, compact=True)
    with pytest.raises(ValueError, match="compact"):
        _run(model, torch.randint(0, 128, (1, 10)), cache)


def _summary(b, hkv, d, counts):
    gen = torch.Generator().manual_seed(7)
    mk, mv = torch.randn(b, hkv, 1, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen)
    n = torch.tensor(counts, dtype=torch.float32).view(b, hkv)
    logn = torch.where(n > 0, n.clamp(min=1).log(), torch.full_like(n, -math.inf)).view(b, hkv, 1, 1)
    return mk, mv, logn


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("bits,g,softcap", [(4, 3, None), (8, 1, None), (32, 3, 30.0)])
def test_the_fused_decode_reads_the_mean_slot_as_attend_does(backend, bits, g, softcap):
    """The kernels' summary (one more slot before the new key, its log n a bias) against attend's
    column over the same keys dequantized, with a mask and a head that evicted nothing."""
    from kvevict.kernels import BACKENDS, Run
    from kvevict.storage.codes import dequantize, quantize

    if backend == "cpu" and not BACKENDS["cpu"].available()[0]:
        pytest.skip("the compiled CPU kernel cannot be built here")
    torch.manual_seed(8)
    b, hkv, d, n = 2, 2, 64, 40
    q = torch.randn(b, hkv * g, 1, d)
    k, v = torch.randn(b, hkv, n, d) * 2, torch.randn(b, hkv, n, d)
    k_new, v_new = torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
    if bits == 32:
        run, kd, vd = Run(32, 0, (k,), (v,), n), k, v
    else:
        kq, vq = quantize(k, bits, 32), quantize(v, bits, 32)
        run = Run(bits, 32, kq, vq, n)
        kd, vd = dequantize(*kq, bits, 32, torch.float32), dequantize(*vq, bits, 32, torch.float32)
    mask = torch.ones(b, 1, n, dtype=torch.bool)
    mask[1, :, :6] = False
    summary = _summary(b, hkv, d, [[12, 0], [3, 250]])
    out, pg = BACKENDS[backend].fn(q, [run], k_new, v_new, mask, d**-0.5, softcap, summary=summary)
    seg = generic_segments(torch.cat([kd, k_new], 2), torch.cat([vd, v_new], 2), 1, None)
    seg.valid_past, seg.pos_past = mask.expand(b, hkv, n), torch.arange(n).view(1, 1, n)
    seg.summary = summary
    want, stats = attend(q, seg, d**-0.5, None, softcap, ("sum",))
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pg, stats["sum"], atol=1e-6, rtol=1e-5)
    assert pg.shape == (b, hkv, n + 1)
    left = pg.sum(-1)  # the mean slot's share is no stored slot's: less than g is left, but where none was evicted
    assert abs(float(left[0, 1]) - g) < 1e-4 and bool((left.flatten()[[0, 2, 3]] < g - 1e-3).all())
