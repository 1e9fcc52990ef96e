"""Sliding-window layers (Gemma 2/3, Mistral-style configs): a layer the model declares sliding
keeps at most the W - 1 tokens the stock cache keeps, exactly those with a covering budget, and
only tokens still inside the window with a smaller one."""

import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

import kvevict
from kvevict.shape import layer_windows

W = 8


def tiny_gemma3(seed=0):
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=W,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=256,
    )
    return Gemma3ForCausalLM(cfg).eval()


def _padded(batch=3, length=30):
    ids = torch.randint(1, 128, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :11] = 0
    return ids, mask


def test_layer_windows_follow_the_stock_cache():
    assert layer_windows(tiny_gemma3()) == [W, W, W, None]
    torch.manual_seed(0)
    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=W,
        )
    )
    stock = DynamicCache(config=mistral.config)
    assert layer_windows(mistral) == [W, W] and all(layer.is_sliding for layer in stock.layers)


def test_a_covering_budget_is_exact_batched_with_padding_and_sliding_layers_hold_the_window():
    model = tiny_gemma3()
    ids, mask = _padded()
    with torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            cache=DynamicCache(config=model.config),
            output_logits=True,
            return_dict_in_generate=True,
        )
        cache = kvevict.make_cache(model, "h2o", 1000)
        got = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            cache=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert torch.allclose(a, b, atol=1e-4)
    for layer, window in zip(cache.layers, layer_windows(model)):
        if window is not None:  # the stock cache's W - 1 tokens, no statistic per slot
            assert layer.budget == layer.tiers[0].capacity == W - 1 and not layer.tiers[0].stats
            t, newest = layer.tiers[0], layer.n_real.view(-1, 1, 1) - 1
            assert ((t.pos > newest + 1 - W) | ~t.valid).all() and t.valid.all()
        else:
            assert layer.budget == 1000


def test_a_small_budget_keeps_only_tokens_inside_the_window():
    model = tiny_gemma3()
    ids, mask = _padded()
    cache = kvevict.make_cache(model, "h2o", 4)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=cache)
    newest = cache.layers[0].n_real.view(-1, 1, 1) - 1
    for layer in cache.layers[:3]:
        t = layer.tiers[0]
        assert t.capacity == 4
        # every kept token can still be seen by the next query: pos > newest + 1 - W
        assert ((t.pos > newest + 1 - W) | ~t.valid).all()


def test_mixed_precision_on_a_sliding_layer_never_holds_more_than_the_window():
    model = tiny_gemma3()
    cache = kvevict.make_cache(model, "h2o", 3, kv_bits=8, evicted_bits=4, group=32)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 40)), cache=cache, use_cache=True)
    for layer in cache.layers[:3]:
        assert sum(t.capacity for t in layer.tiers) <= W - 1
    assert sum(t.capacity for t in cache.layers[3].tiers) == 3 + 37  # the global layer: the whole prompt
