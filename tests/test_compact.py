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
        for part in [ids] + [steps[:, i : i + 1] for i in range(3)]:
            assert (model(part, cache=ref_cache).logits - model(part, cache=cache).logits).abs().max() < 1e-4


def test_compact_mode_keeps_distances_within_the_cache_far_past_the_context():
    model = tiny_model("llama-gqa")  # max_position_embeddings 512
    budget = 16
    cache = kvevict.make_cache(model, "recency", budget=budget, compact=True)
    plain = kvevict.make_cache(model, "recency", budget=budget)
    token = torch.randint(0, 128, (1, 1))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 40)), cache=cache)
        model(torch.randint(0, 128, (1, 40)), cache=plain)
        for _ in range(600):  # past the context length
            out = model(token, cache=cache).logits
            model(token, cache=plain)
    assert torch.isfinite(out).all()
    layer = cache.layers[0]
    assert layer.pos.max().item() == 639
    # same kept tokens as without compaction (recency keeps sinks + newest either way)
    assert torch.equal(layer.pos.sort(-1).values, plain.layers[0].pos.sort(-1).values)


def _one_layer_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def test_compact_stream_far_past_the_context_equals_the_kept_tokens_at_positions_0_to_budget():
    """One layer: a key depends only on its token and position. After 1,500 tokens (3x the 512
    positions), sinks + window under compact positions must give exactly the logits of a fresh
    full-cache run on the kept tokens alone, at positions 0..budget: every distance the model sees
    is a rank in the cache."""
    model = _one_layer_model()
    budget, sinks = 16, 4
    ids = torch.randint(0, 128, (1, 1500), generator=torch.Generator().manual_seed(2))
    cache = kvevict.make_cache(model, "recency", budget=budget, sinks=sinks, compact=True)
    plain = kvevict.make_cache(model, "recency", budget=budget, sinks=sinks)
    with torch.no_grad():
        for s in range(0, 1499, 50):
            model(ids[:, s : min(1499, s + 50)], cache=cache)
            model(ids[:, s : min(1499, s + 50)], cache=plain)
        got = model(ids[:, 1499:], cache=cache).logits[0, -1]
        far = model(ids[:, 1499:], cache=plain).logits[0, -1]
        kept = torch.cat([ids[:, :sinks], ids[:, 1499 - (budget - sinks) :]], 1)  # sinks + the newest
        model.set_attn_implementation("sdpa")
        want = model(kept, cache=DynamicCache(config=model.config)).logits[0, -1]
    assert (got - want).abs().max() < 1e-4
    assert (far - want).abs().max() > 1e-3  # without compaction the distances are up to 1,499 (seeded: 2.5e-3)
