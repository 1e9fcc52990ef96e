"""The cache's core behaviour: exactness, real drop = simulation, memory bound, batching, errors."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import ARCHS, tiny_model
from h2o_reference import H2OReference


def _logits(model, ids, cache, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, cache=cache).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_covering_everything_equals_dynamic_cache(arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    prompt, steps = torch.randint(0, 128, (2, 24)), torch.randint(0, 128, (2, 6))
    ref_cache, cache = DynamicCache(config=model.config), None
    ref = [_logits(model, prompt, ref_cache)]
    ref += [_logits(model, steps[:, i : i + 1], ref_cache) for i in range(steps.shape[1])]
    cache = kvevict.make_cache(model, "h2o", budget=30)
    got = [_logits(model, prompt, cache)]
    got += [_logits(model, steps[:, i : i + 1], cache) for i in range(steps.shape[1])]
    for r, g in zip(ref, got):
        assert (r - g).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
def test_real_eviction_matches_masked_eager_reference(arch):
    budget, recent, new = 12, 4, 25
    model = tiny_model(arch)
    torch.manual_seed(2)
    prompt = torch.randint(0, 128, (2, 20))
    cache = kvevict.make_cache(model, "h2o", budget=budget, recent=recent)
    got = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        cache=cache,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
    )
    ref = H2OReference(budget, recent)
    model.set_attn_implementation(ref.NAME)
    want = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    assert torch.equal(got, want)
    # and eviction really changed the answer vs the full cache, else the test proves nothing
    model.set_attn_implementation("sdpa")
    full = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    assert not torch.equal(full, want)


def test_kv_bytes_is_exactly_the_budget_and_stays_there():
    model = tiny_model("llama-gqa")
    cfg = model.config
    budget, batch = 16, 2
    cache = kvevict.make_cache(model, "h2o", budget=budget)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # per slot: key + value (fp32), position (int16, -1 for an empty slot), H2O's accumulated
    # attention (float16); per layer and sequence: its count of real tokens (int64)
    slot = head_dim * 2 * 4 + 2 + 2
    expected = (budget * cfg.num_key_value_heads * slot + 8) * cfg.num_hidden_layers * batch
    ids = torch.randint(0, 128, (batch, 40))
    _logits(model, ids, cache)
    assert cache.kv_bytes() == expected
    storage = [layer.keys.data_ptr() for layer in cache.layers]
    token = torch.randint(0, 128, (batch, 1))
    for _ in range(200):
        token = _logits(model, token, cache)[:, -1:].argmax(-1)
        assert cache.kv_bytes() == expected
    assert cache.get_seq_length() == 240  # positions go on although only 16 tokens are kept
    assert [layer.keys.data_ptr() for layer in cache.layers] == storage  # written in place, never reallocated
    # a stock cache of the same tokens: 16 bits a value (every ratio's denominator), or the model's fp32
    stock16 = 240 * cfg.num_key_value_heads * head_dim * 2 * 2 * cfg.num_hidden_layers * batch
    assert cache.full_kv_bytes() == stock16 and cache.full_kv_bytes(dtype_bytes=None) == 2 * stock16


def test_float_budget_is_a_fraction_of_the_prompt():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=0.25)
    _logits(model, torch.randint(0, 128, (1, 40)), cache)
    assert cache.budget == 10
    assert all(layer.keys.shape[2] == 10 for layer in cache.layers)


# 20: the 17-token prompt has room for its tokens, the others do not (its padding is stored then)
@pytest.mark.parametrize("budget", [8, 20, 64])
def test_left_padded_batch_equals_each_prompt_alone(budget):
    model = tiny_model("llama-gqa")
    torch.manual_seed(3)
    prompts = [torch.randint(1, 128, (n,)) for n in (30, 17, 24)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, cache=kvevict.make_cache(model, "h2o", budget=budget), **gen)
    for i, p in enumerate(prompts):
        alone = model.generate(
            p[None],
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            cache=kvevict.make_cache(model, "h2o", budget=budget),
            **gen,
        )
        assert torch.equal(batched[i, width:], alone[0, len(p) :]), f"sequence {i}"


def test_padding_is_never_kept_over_a_real_token():
    model = tiny_model("llama-gqa")
    ids = torch.randint(1, 128, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # sequence 1 has 10 real tokens, budget 8: no pad may survive
    cache = kvevict.make_cache(model, "h2o", budget=8)
    _logits(model, ids, cache, mask)
    for layer in cache.layers:
        assert layer.valid.all()
        assert (layer.pos[1] < 10).all() and (layer.pos[1] >= 0).all()


def test_h2o_keeps_recent_window_and_heavy_hitters_after_prefill():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=10, recent=4)
    _logits(model, torch.randint(0, 128, (1, 50)), cache)
    for layer in cache.layers:
        for h in range(layer.pos.shape[1]):
            kept = set(layer.pos[0, h].tolist())
            assert {46, 47, 48, 49} <= kept and len(kept) == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=0), "positive"),
        (dict(budget=-3), "positive"),
        (dict(budget=1.5), "(0, 1]"),
        (dict(budget=0.0), "(0, 1]"),
        (dict(budget="20%"), "budget must be"),
        (dict(budget=8, recent=8), "recent=8 must be smaller"),
        (dict(budget=8, recent=20), "recent=20 must be smaller"),
        (dict(budget=8, policy="h20"), "unknown policy 'h20'; known policies:"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, message):
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError) as err:
        kvevict.make_cache(model, **kwargs)
    assert message in str(err.value)


def test_fractional_budget_too_small_for_recent_fails_clearly():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=0.1, recent=5)  # 10% of 30 = 3 tokens < recent
    with pytest.raises(ValueError, match="recent=5 must be smaller than the budget"):
        _logits(model, torch.randint(0, 128, (1, 30)), cache)


def test_model_that_cannot_be_hooked_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    class Legacy(torch.nn.Module):  # a decoder with hand-written attention, not AttentionInterface
        config = GPT2Config(n_layer=1)

    with pytest.raises(ValueError, match="AttentionInterface"):
        kvevict.make_cache(Legacy(), "h2o", budget=8)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    cache = kvevict.make_cache(gpt2, "h2o", budget=8)  # GPT-2 does route through the interface
    gpt2(torch.randint(0, 64, (1, 20)), cache=cache)
    assert cache.kv_bytes() == 8 * 2 * (16 * 2 * 4 + 2 + 2) + 8  # slots x heads x (K, V, pos, fp16 sum) + n_real


def test_a_rejected_attention_call_leaves_the_cache_usable():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=8)
    ids = torch.randint(0, 128, (1, 12))
    bad_mask = torch.zeros(1, 1, 12, 12)  # a prepared 4-D mask is refused with a clear message
    with pytest.raises(ValueError, match="2-D attention_mask"):
        model(ids, attention_mask=bad_mask, cache=cache)
    fresh = kvevict.make_cache(model, "h2o", budget=8)
    _logits(model, ids, fresh)  # no stale state from the refused call
    assert fresh.get_seq_length() == 12
