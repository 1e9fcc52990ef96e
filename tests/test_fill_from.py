"""A prompt scored by KVzip runs through the model once: the budgeted cache is filled from the
scoring pass's own cache (kvevict.prefill.fill_from) and keeps what the prompt's forward keeps."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.generate import generate
from kvevict.policies.kvzip import KVzip
from kvevict.prefill import fill_from
from tiny_chat_model import char_tokenizer


def _context(model, ids):
    context = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(ids, cache=context, use_cache=True)
    return context


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize(
    "kw", [dict(budget=20), dict(budget=24, kv_bits=4), dict(budget=16, kv_bits=8, evicted_bits=4)]
)
def test_filled_from_the_scoring_pass_keeps_what_the_prompts_forward_keeps(arch, kw):
    model, tok = tiny_model(arch), char_tokenizer()
    ids = tok("hello there, this is a longer prompt to compress " * 3, return_tensors="pt").input_ids
    ctx = ids[:, :-1]
    context = _context(model, ctx)
    policy = KVzip.record(model, tok, ctx, context=context)
    assert context.get_seq_length() == ctx.shape[1]  # left as given: the pieces were cropped off
    assert torch.allclose(
        torch.stack([s.float() for s in policy.scores]),
        torch.stack([s.float() for s in KVzip.record(model, tok, ctx).scores]),
        atol=1e-5,
    )
    filled, run = (kvevict.make_cache(model, policy, **kw) for _ in range(2))
    fill_from(filled, context)
    with torch.no_grad():
        model(ctx, cache=run, use_cache=True)
    for a, b in zip(filled.layers, run.layers):
        for ta, tb in zip(a.tiers, b.tiers):
            assert torch.equal(ta.pos, tb.pos)  # the same tokens in the same slots
    assert filled.kv_bytes() == run.kv_bytes() and filled.get_seq_length() == run.get_seq_length()
    outs = [
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=c,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        for c in (filled, run)
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.allclose(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=1e-4)


def test_generate_scores_kvzip_in_one_pass_over_the_prompt():
    """generate's kvzip path (the prompt but its last token run once, scored on top, fill_from, then
    the last token fed by generate) answers as recording and prefilling apart does."""
    model, tok = tiny_model("llama-gqa"), char_tokenizer()
    ids = tok("a prompt of some length that the cache will not hold whole " * 2, return_tensors="pt").input_ids
    got = generate(model, tok, ids, policy="kvzip", budget=24, max_new_tokens=8)
    cache = kvevict.make_cache(model, KVzip.record(model, tok, ids[:, :-1]), budget=24)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert got.text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert got.kv_bytes == cache.kv_bytes()


def test_fill_from_refuses_what_it_cannot_give():
    model, tok = tiny_model("llama-gqa"), char_tokenizer()
    ids = tok("some prompt text " * 4, return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="collects sum from the prompt's attention"):
        fill_from(kvevict.make_cache(model, "h2o", budget=16), _context(model, ids))
    with pytest.raises(ValueError, match="holds 10 tokens, the prompt has"):
        KVzip.record(model, tok, ids, context=_context(model, ids[:, :10]))


@pytest.mark.parametrize(
    "kw", [dict(budget=20), dict(budget=16, kv_bits=8, evicted_bits=4), dict(budget=5, recent=2), dict(memory=0.3)]
)
def test_a_sliding_model_is_filled_from_a_cache_that_kept_only_its_windows(kw):
    """Gemma 3's sliding layers: the scoring pass's cache keeps their last W - 1 tokens only, the
    reconstruction crops back to them, and the budgeted cache filled from it keeps what the
    prompt's own forward keeps, positions included, and decodes the same."""
    from test_sliding import W, tiny_gemma3

    model, tok = tiny_gemma3(), char_tokenizer()
    ids = tok("a sliding window forgets what is far, " * 3, return_tensors="pt").input_ids
    ctx = ids[:, :-1]
    context = _context(model, ctx)
    assert context.layers[0].keys.shape[2] == W - 1 < ctx.shape[1]  # the window only
    recent = {"recent": kw.pop("recent")} if "recent" in kw else {}  # a budget inside the window: kvzip ranks there
    policy = KVzip.record(model, tok, ctx, context=context, **recent)
    assert context.get_seq_length() == ctx.shape[1] and context.layers[0].keys.shape[2] == W - 1
    assert not context.layers[0].record_past  # left as given
    whole = KVzip.record(model, tok, ctx, **recent)  # one pass over [context, repeat, context], every key held
    assert torch.allclose(
        torch.stack([s.float() for s in policy.scores]), torch.stack([s.float() for s in whole.scores]), atol=1e-5
    )
    filled, run = (kvevict.make_cache(model, policy, **kw) for _ in range(2))
    fill_from(filled, context)
    run.set_prompt_length(ctx.shape[1])
    with torch.no_grad():
        model(ctx, cache=run, use_cache=True)
    for a, b in zip(filled.layers, run.layers):
        assert a.seen == b.seen == ctx.shape[1] and torch.equal(a.n_real, b.n_real)
        for ta, tb in zip(a.tiers, b.tiers):
            assert torch.equal(ta.pos, tb.pos)  # the same tokens in the same slots
    assert filled.kv_bytes() == run.kv_bytes()
    outs = [
        model.generate(
            ids, cache=c, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        for c in (filled, run)
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    # the keys and values were made by SDPA here, by kvevict's attention there: equal up to float
    # rounding, which a quantized slot can carry across a rounding boundary
    tol = 2e-3 if "kv_bits" in kw else 1e-4
    assert torch.allclose(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=tol)


def test_only_a_sliding_layer_skips_tokens():
    model, tok = tiny_model("llama-gqa"), char_tokenizer()
    ids = tok("some prompt text " * 4, return_tensors="pt").input_ids
    context = _context(model, ids)
    context.layers[1].keys = context.layers[1].keys[:, :, -8:]  # as if it kept a window it does not have
    context.layers[1].values = context.layers[1].values[:, :, -8:]
    cache = kvevict.make_cache(model, KVzip.record(model, tok, ids), budget=16)
    with pytest.raises(ValueError, match="holds 8 of its"):
        fill_from(cache, context)
    with pytest.raises(ValueError, match="only a sliding-window layer can skip"):
        cache.layers[0].skip(1)
