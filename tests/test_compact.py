"""Compact positions: keys re-rotated to their rank among kept tokens (StreamingLLM)."""

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvevict
from conftest import tiny_model
from kvevict.rope import compact_positions, rope_inv_freq, shift_keys


def test_shifting_a_rotated_key_equals_rotating_it_at_the_new_position():
    model = tiny_model("llama-gqa")
    rope = model.model.rotary_emb
    torch.manual_seed(0)
    k = torch.randn(1, 2, 5, 8)
    pos = torch.tensor([[3, 17, 40, 41, 99]])
    new = torch.tensor([[0, 1, 2, 3, 4]])
    cos, sin = rope(k, pos)
    rotated, _ = apply_rotary_pos_emb(k, k, cos, sin)
    cos2, sin2 = rope(k, new)
    want, _ = apply_rotary_pos_emb(k, k, cos2, sin2)
    got = shift_keys(rotated, (new - pos).view(1, 1, 5).expand(1, 2, 5), rope_inv_freq(model))
    assert torch.allclose(got, want, atol=1e-5)


def test_compact_positions_rank_the_kept_tokens():
    pos = torch.tensor([[[40, 3, 99, 17, 7]]])
    valid = torch.tensor([[[True, True, True, True, False]]])
    assert compact_positions(pos, valid).tolist() == [[[2, 0, 3, 1, 4]]]


def test_compact_mode_without_eviction_is_exact():
    model = tiny_model("llama-gqa")
    ids, steps = torch.randint(0, 128, (2, 20)), torch.randint(0, 128, (2, 3))
    ref_cache = DynamicCache(config=model.config)
    cache = kvevict.make_cache(model, "h2o", budget=32, compact=True)
    with torch.no_grad():
        for part in [ids] + [steps[:, i:i + 1] for i in range(3)]:
            assert (model(part, past_key_values=ref_cache).logits
                    - model(part, past_key_values=cache).logits).abs().max() < 1e-4


def test_compact_mode_keeps_distances_within_the_cache_far_past_the_context():
    model = tiny_model("llama-gqa")  # max_position_embeddings 512
    budget = 16
    cache = kvevict.make_cache(model, "recency", budget=budget, compact=True)
    plain = kvevict.make_cache(model, "recency", budget=budget)
    token = torch.randint(0, 128, (1, 1))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 40)), past_key_values=cache)
        model(torch.randint(0, 128, (1, 40)), past_key_values=plain)
        for _ in range(600):  # past the context length
            out = model(token, past_key_values=cache).logits
            model(token, past_key_values=plain)
    assert torch.isfinite(out).all()
    layer = cache.layers[0]
    ranks = compact_positions(layer.pos, layer.valid)
    # the compact shift puts the newest kept token right before the next query
    assert (layer.n_real - layer.filled).item() == 640 - budget
    assert ranks.max().item() == budget - 1 and layer.pos.max().item() == 639
    # same kept tokens as without compaction (recency keeps sinks + newest either way)
    assert torch.equal(layer.pos.sort(-1).values, plain.layers[0].pos.sort(-1).values)
