"""Eviction in batches (``slack``): a full layer ranks once every ``slack`` steps and evicts that
many tokens at once; the steps between write into the freed slots unranked. The budget stays the
most a layer holds, so the memory bound is the same as evicting one token a step."""

import pytest
import torch

import kvevict
from conftest import tiny_model
from h2o_reference import H2OReference
from kvevict.budget import default_slack
from kvevict.turnover import recent_slots


def _decode(model, spec, prompt, steps, **kw):
    """The cache and, after each decode step, every layer's tokens held per (row, KV head)."""
    cache = kvevict.make_cache(model, spec, **kw)
    cache.set_prompt_length(prompt.shape[1])
    held, tokens = [], []
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(tok)
            held.append([(t.pos[..., : t.filled] >= 0).sum(-1) for layer in cache.layers for t in layer.tiers[:1]])
    return cache, held, torch.cat(tokens, 1)


@pytest.mark.parametrize("slack", [1, 3, 5])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
def test_batch_eviction_matches_the_reference_that_evicts_slack_tokens_at_once(arch, slack):
    budget, recent, new = 12, 4, 25
    model = tiny_model(arch)
    torch.manual_seed(2)
    prompt = torch.randint(0, 128, (2, 20))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    cache = kvevict.make_cache(model, "h2o", budget=budget, recent=recent, slack=slack)
    got = model.generate(prompt, cache=cache, **kw)
    ref = H2OReference(budget, recent, slack)
    model.set_attn_implementation(ref.NAME)
    assert torch.equal(got, model.generate(prompt, **kw))
    if slack > 1:  # and the batches changed the answer, else the reference proves nothing of them
        one = kvevict.make_cache(model, "h2o", budget=budget, recent=recent)
        assert not torch.equal(got, model.generate(prompt, cache=one, **kw))


@pytest.mark.parametrize("spec", ["h2o", "snapkv/int4", "ada-snapkv/int8+int4", "tova", "merge-h2o", "h2o/fp+int4"])
def test_slack_one_evicts_every_step_and_the_default_a_sixteenth_of_the_budget(spec):
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 300))
    one, held_one, _ = _decode(model, f"{spec}@150+slack=1", prompt, 20)
    auto, held_auto, _ = _decode(model, f"{spec}@150", prompt, 20)
    pooled = one.layers[0].shared
    for layers in held_one:  # full after every step: one in, one out
        assert all((h == 150 * pooled).all() for h in layers)
    assert auto.layers[0].tiers[0].slack == 9  # 150 // 16
    want = [(150 - (8 - i % 9)) * pooled for i in range(20)]
    for step, layers in enumerate(held_auto):
        assert all((h == want[step]).all() for h in layers), step
    assert kvevict.make_cache(model, f"{spec}@127").layers[0].slack is None  # resolved per layer, at the prompt
    for budget, slack in ((31, 1), (32, 2), (256, 16), (280, 16)):
        cache, _, _ = _decode(model, f"{spec}@{budget}", prompt, 1)
        assert cache.layers[0].tiers[0].slack == slack, budget


@pytest.mark.parametrize("spec", ["h2o/int4@memory=0.25", "ada-snapkv/int4@memory=0.2", "snapkv/int8@memory=0.3"])
def test_a_memory_plans_default_slack_is_the_largest_whose_recent_tier_fits_a_sixteenth(spec):
    model = tiny_model("qwen2").to(torch.bfloat16)  # a recent tier costs 2 bytes a value, as on real models
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 400))
    cache = kvevict.make_cache(model, spec)
    cache.set_prompt_length(prompt.shape[1])
    held = []
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(20):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t = cache.layers[0].tiers[0]  # its tokens, and those waiting in its recent tier
            held.append(sum((p.pos[..., : p.filled] >= 0).sum(-1) for p in t.parts()))
    layer = cache.layers[0]
    t, pooled, planned = layer.tiers[0], layer.shared, layer.budget + layer.recent_cost
    s = t.slack
    stats, heads = layer.policy.stats, layer.shared > 1
    cost = [recent_slots(layer.storage, n, layer.dims[1:], layer.dtype, stats, heads) for n in (s, s + 1)]
    # the default (a sixteenth of the plan's tokens) would quantize every step: the slack shrank
    # to the largest whose recent tier fits, and the plan paid for it in slots
    assert 2 <= s < default_slack(planned) and cost[0] * 16 <= planned < cost[1] * 16
    assert t.recent is not None and layer.recent_cost == cost[0]
    # one ranking every s steps, the tokens between waiting in 16 bits: never more than the budget
    want = [(layer.budget - (s - 1 - i % s)) * pooled for i in range(20)]
    for step, h in enumerate(held):
        assert (h == want[step]).all(), (step, h.tolist(), want[step])
    given = kvevict.make_cache(model, f"{spec}+slack=12")
    given.set_prompt_length(prompt.shape[1])
    with torch.no_grad():
        model(prompt, cache=given, use_cache=True)
    assert given.layers[0].tiers[0].slack == 12 and given.layers[0].recent_cost == 0  # asked for: kept


@pytest.mark.parametrize("spec", ["h2o@12", "snapkv/int8@12", "ada-snapkv/int8+int4@12", "h2o/int4+int2@12"])
def test_a_layer_holds_its_budget_at_most_and_turns_over_slack_tokens_at_once(spec):
    slack, steps = 4, 16
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 30))
    cache, held, _ = _decode(model, f"{spec}+slack={slack}", prompt, steps)
    one, _, _ = _decode(model, spec, prompt, steps)
    pooled = cache.layers[0].shared  # Ada-KV: the heads' slots in one row, each step brings one per head
    budget = cache.layers[0].budget * pooled
    # each step: the first ranks (budget - s + 1 left after the new token), the next s - 1 add one each
    want = [budget - (slack - 1 - i % slack) * pooled for i in range(steps)]
    for step, layers in enumerate(held):
        for h in layers:
            assert (h == want[step]).all(), (step, h.tolist(), want[step])
    # the free slots are slots the budget holds: every byte counted, the same bytes as one a step
    assert cache.kv_bytes() == one.kv_bytes()


def test_a_memory_budget_with_slack_holds_the_bytes_of_one_a_step():
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 400))
    held = {}
    for slack in (1, 16):
        cache, _, _ = _decode(model, f"h2o/int4@memory=0.25+slack={slack}", prompt, 32)
        assert cache.layers[0].tiers[0].slack == slack
        held[slack] = cache.kv_bytes()
    assert held[16] == held[1]
    # the plan's bytes: up to one slot of rounding per layer, row and KV head
    t = cache.layers[0].tiers[0]
    rows_heads = 2 * cache.layers[0].dims[0]
    rounding = len(cache.layers) * rows_heads * t.nbytes() / (rows_heads * t.capacity)
    assert 0.8 * 0.25 * cache.full_kv_bytes() <= held[16] <= 0.25 * cache.full_kv_bytes() + rounding


def test_rows_that_leave_mid_turn_over_leave_the_rest_within_budget_and_unchanged_bytes():
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (3, 30))
    cache = kvevict.make_cache(model, "h2o@12+slack=5")
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(3):  # a ranking, then two of its four free slots taken
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        cache.batch_select_indices(torch.tensor([0, 2]))
        tok = tok[[0, 2]]
        before = cache.kv_bytes()
        for _ in range(12):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                t = layer.tiers[0]
                held = (t.pos[..., : t.filled] >= 0).sum(-1)
                assert (held <= 12).all() and (held >= 12 - 5 + 1).all()
                assert t.pos.unique().numel() - 1 <= t.pos.shape[-1]  # no position held twice in a head
        assert cache.kv_bytes() == before


def test_a_paged_cache_turns_over_as_a_rectangle_does():
    from kvevict.storage import Pools

    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 30))
    _, held_r, tok_r = _decode(model, "h2o/int4@12+slack=4", prompt, 10)
    _, held_p, tok_p = _decode(model, "h2o/int4@12+slack=4", prompt, 10, pages=Pools())
    assert torch.equal(tok_r, tok_p)
    assert all(torch.equal(x, y) for hr, hp in zip(held_r, held_p) for x, y in zip(hr, hp))


@pytest.mark.parametrize("slack", [0, -2, 1.5, True, "4"])
def test_a_slack_that_is_not_a_positive_int_says_what_to_give(slack):
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="slack must be a positive int"):
        kvevict.make_cache(model, "h2o", budget=12, slack=slack)


def test_a_slack_larger_than_the_budget_says_what_to_give():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="at most 12"):
        kvevict.make_cache(model, "h2o@12+slack=13")
    with pytest.raises(ValueError, match="names slack already"):
        kvevict.make_cache(model, "h2o@12+slack=4", slack=2)
    with pytest.raises(ValueError, match=r"\+slack= takes a positive int"):
        kvevict.make_cache(model, "h2o@12+slack=0")


def test_the_spec_reads_and_prints_slack():
    from kvevict.spec import CacheSpec

    for text in ("h2o@0.2+slack=16", "memory=0.2+slack=8", "ada-snapkv/int8+int4@memory=0.2+slack=4"):
        assert str(CacheSpec.parse(text)) == text
    assert CacheSpec.parse("snapkv+q/int8@512+slack=32").cache_kwargs() == {
        "kv_bits": 8,
        "evicted_bits": None,
        "budget": 512,
        "slack": 32,
    }


def _garble_free_slots(cache) -> int:
    """Overwrite the stored keys and values of every slot that holds no token; how many there were."""
    n = 0
    for layer in cache.layers:
        for t in layer.tiers:
            hole = (t.pos < 0)[..., : t.capacity]
            n += int(hole.sum())
            store = t.store
            parts = [store.keys, store.values] if hasattr(store, "keys") and not hasattr(store, "k") else []
            if hasattr(store, "k"):  # packed: codes, zeros and steps of K and V
                parts = [*store.k.tensors(), *store.v.tensors()]
            for p in parts:
                p[hole] = (255 if p.dtype == torch.uint8 else 1e4) if p.dtype != torch.bool else True
    return n


@pytest.mark.parametrize("leave", [False, True])  # and after a row left mid-turn-over
@pytest.mark.parametrize(
    "spec", ["h2o@12", "snapkv/int8@12", "ada-snapkv/int8+int4@12", "merge-h2o/int4@12", "h2o/int8+int4@12"]
)
def test_the_slots_a_turn_over_freed_are_never_attended(spec, leave):
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (3, 30))
    out = []
    for garble in (False, True):
        cache = kvevict.make_cache(model, f"{spec}+slack=4")
        with torch.no_grad():
            tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # a ranking: 3 slots freed
            if leave:
                cache.batch_select_indices(torch.tensor([0, 2]))
                tok = tok[[0, 2]]
            logits = []
            for step in range(6):  # past the next ranking
                if garble:
                    assert _garble_free_slots(cache) > 0 or step > 1
                logits.append(model(tok, cache=cache, use_cache=True).logits)
                tok = logits[-1][:, -1:].argmax(-1)
        out.append(torch.cat(logits, 1))
    assert torch.equal(out[0], out[1])


def _with_recent(model, spec, prompt, steps):
    cache = kvevict.make_cache(model, spec)
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        logits = []
        for _ in range(steps):
            logits.append(model(tok, cache=cache, use_cache=True).logits)
            tok = logits[-1][:, -1:].argmax(-1)
    return cache, torch.cat(logits, 1)


@pytest.mark.parametrize("spec", ["h2o/int4@450", "snapkv/int8@450", "ada-snapkv/int4@450", "h2o/int8+int4@450"])
def test_packed_tokens_between_rankings_wait_in_full_precision_and_are_quantized_as_one_group(spec):
    from kvevict.kernels.store import quantize_pair

    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 500))
    cache, _ = _with_recent(model, spec + "+slack=4", prompt, 4)  # a ranking, then 3 tokens waiting
    t = cache.layers[0].tiers[0]
    assert t.recent is not None and t.recent.filled == 3 * cache.layers[0].shared
    r = t.recent
    k, v = r.store.keys[:, :, : r.filled].clone(), r.store.values[:, :, : r.filled].clone()
    pos, slots = r.pos[..., : r.filled].clone(), t.turnover.free[..., : r.filled].clone()
    stats = {n: r.meta(n)[..., : r.filled].clone() for n in r.stat_names}
    assert stats and all((s > 0).any() for s in stats.values())  # attention scored them while they waited
    assert (t.pos.gather(-1, slots) == -1).all()  # their slots wait empty, hidden from attention
    t.flush()
    assert r.filled == 0 and torch.equal(t.pos.gather(-1, slots).long(), pos.long())
    assert all(torch.equal(t.meta(n).gather(-1, slots), s) for n, s in stats.items())
    want = quantize_pair(k, v, t.store.bits, t.store.group)  # the reference, token by token the same
    got = [
        p.gather(2, slots[..., None].expand(*slots.shape, p.shape[-1]))
        for p in (*t.store.k.tensors(), *t.store.v.tensors())
    ]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("spec", ["h2o/int4@450", "ada-snapkv/int8+int4@450", "merge-h2o/int4@450"])
def test_a_recent_tiers_slots_and_the_freed_ones_are_never_attended(spec):
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 500))
    out = []
    for garble in (False, True):
        cache = kvevict.make_cache(model, f"{spec}+slack=4")
        with torch.no_grad():
            tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            logits = []
            for _ in range(9):  # rankings at steps 0, 4 and 8
                if garble:
                    _garble_free_slots(cache)
                logits.append(model(tok, cache=cache, use_cache=True).logits)
                tok = logits[-1][:, -1:].argmax(-1)
        assert cache.layers[0].tiers[0].recent is not None
        out.append(torch.cat(logits, 1))
    assert torch.equal(out[0], out[1])


def test_a_memory_budget_holds_the_recent_tier_too():
    model = tiny_model("qwen2").to(torch.bfloat16)  # a recent tier costs 2 bytes a value, as on real models
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 2000))
    for spec in ("h2o/int4@memory=0.25", "ada-snapkv/int4@memory=0.2"):
        share = 0.25 if "0.25" in spec else 0.2
        cache, _ = _with_recent(model, spec, prompt, 20)
        t = cache.layers[0].tiers[0]
        assert t.slack == 16 and t.recent is not None
        one, _ = _with_recent(model, spec + "+slack=1", prompt, 20)
        assert cache.layers[0].budget < one.layers[0].budget  # the recent tier's bytes came out of the slots
        assert cache.kv_bytes() <= one.kv_bytes() + len(cache.layers) * 2 * t.nbytes() / (2 * t.capacity)
        assert cache.kv_bytes() <= share * cache.full_kv_bytes()


def test_a_sliding_layer_evicts_every_step_as_the_stock_cache_does():
    from transformers import DynamicCache

    from test_sliding import W, _padded, tiny_gemma3

    model = tiny_gemma3()
    ids, mask = _padded()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        cache = kvevict.make_cache(model, "h2o@1000+slack=8")
        got = model.generate(ids, cache=cache, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got.logits, ref.logits))
    assert [layer.tiers[0].slack for layer in cache.layers] == [1, 1, 1, 8]  # W - 1 = 7 slots slide
    assert W - 1 < 8
