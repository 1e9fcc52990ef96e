"""Gemma 3: sliding-window layers (``sliding_window`` tokens) mixed with global ones, one KV head,
query_pre_attn_scalar scaling. With a budget that covers the sequence, the budgeted cache must give
the stock DynamicCache's logits (which keeps only the window in sliding layers): batched, left
padded, over a prompt longer than the window and decode steps past it."""

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import kvevict
from kvevict.generate import encode_chat, generate, plain_text

WINDOW = 8


def tiny_gemma(head_dim=64, seed=0):
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


def _logits(model, cache, ids, mask, steps):
    """Prompt forward, then one forward per decode token; every row's logits at every step."""
    out = []
    with torch.no_grad():
        out.append(model(ids, attention_mask=mask, cache=cache).logits)
        for i in range(steps.shape[1]):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out.append(model(steps[:, i : i + 1], attention_mask=mask, cache=cache).logits)
    return out


@pytest.mark.parametrize("head_dim", [64, 256])
def test_covering_budget_equals_the_stock_cache_batched_and_padded(head_dim):
    model = tiny_gemma(head_dim)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, 3 * WINDOW + 5), generator=g)  # 29 tokens: past the window
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, : WINDOW + 3] = 0  # a row padded past a whole window
    steps = torch.randint(1, 128, (3, WINDOW + 2), generator=g)  # decoding slides the window on
    model.set_attn_implementation("sdpa")
    ref_cache = DynamicCache(config=model.config)
    ref = _logits(model, ref_cache, ids, mask, steps)
    assert ref_cache.layers[0].keys.shape[2] < ids.shape[1]  # the stock cache keeps only the window there
    cache = kvevict.make_cache(model, "h2o", ids.shape[1] + steps.shape[1])
    got = _logits(model, cache, ids, mask, steps)
    real = mask.bool()
    assert (ref[0][real] - got[0][real]).abs().max().item() < 1e-4  # padding positions' logits are meaningless
    for r, g_ in zip(ref[1:], got[1:]):
        assert (r - g_).abs().max().item() < 1e-4


def test_covering_budget_generates_the_stock_tokens():
    model = tiny_gemma()
    ids = torch.randint(1, 128, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    kw = dict(
        attention_mask=mask, do_sample=False, max_new_tokens=2 * WINDOW, min_new_tokens=2 * WINDOW, pad_token_id=0
    )
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    got = model.generate(ids, cache=kvevict.make_cache(model, "tova", 5 * WINDOW), **kw)
    assert torch.equal(ref, got)


def test_a_small_budget_stays_within_it_on_every_layer():
    model = tiny_gemma()
    ids = torch.randint(1, 128, (1, 4 * WINDOW))
    cache = kvevict.make_cache(model, "h2o", 6)
    with torch.no_grad():
        model.generate(ids, cache=cache, do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert all(layer.filled == 6 for layer in cache.layers)


class _NoTemplate:
    """A base model's tokenizer: no chat template (apply_chat_template would raise)."""

    chat_template = None

    def __call__(self, text, return_tensors=None):
        ids = [2] + [3 + ord(c) % 100 for c in text]  # a BOS, then one id per character
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")


def test_messages_to_a_model_without_chat_template_are_plain_text():
    tok = _NoTemplate()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find it.\n\nWhat is it?"}]
    assert plain_text(msgs) == "Be brief.\n\nFind it.\n\nWhat is it?"
    assert encode_chat(tok, msgs)[0].tolist() == tok(plain_text(msgs))["input_ids"]
    with pytest.raises(ValueError, match="list of"):
        encode_chat(tok, [{"role": "user"}])


def test_generate_runs_a_base_model_on_messages():
    model, tok = tiny_gemma(), _NoTemplate()
    tok.pad_token_id, tok.decode = 0, lambda ids, skip_special_tokens=True: " ".join(map(str, ids.tolist()))
    msgs = [{"role": "user", "content": "x" * 30}]
    full = generate(model, tok, msgs, "full", max_new_tokens=4)
    ours = generate(model, tok, msgs, "h2o", 64, max_new_tokens=4)
    assert full.prompt_tokens == 31 and full.text == ours.text  # covering budget: the same answer


def test_compact_positions_are_refused_with_a_clear_error():
    """Sliding and full layers rotate with different RoPE bases: one re-rotation cannot serve both."""
    with pytest.raises(ValueError, match="sliding_attention layers with different RoPE"):
        kvevict.make_cache(tiny_gemma(), "h2o", 16, compact=True)


def test_server_refuses_chat_for_a_model_without_template():
    from kvevict.serve.protocol import BadRequest, parse_chat
    from kvevict.serve.settings import Settings

    with pytest.raises(BadRequest, match="no chat template .* /v1/completions"):
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, _NoTemplate(), Settings(model_id="m"), 256)
