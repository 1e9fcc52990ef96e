"""What a new user gets wrong first: an empty prompt, a used cache given a new prompt, a prompt past
the model's positions. Each is a clear ValueError (or a one-line warning) raised before the model
runs, never a traceback from inside transformers' attention."""

import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvevict
from conftest import TINY, tiny_model
from kvevict.generate import generate
from tiny_chat_model import char_tokenizer


def _greedy(model, ids, cache, n=4, mask=None):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        cache=cache,
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )


# (1) an empty prompt ------------------------------------------------------------------------------


def test_empty_prompt_is_a_value_error_from_kvevict_generate():
    model, tok = tiny_model(), char_tokenizer()
    assert tok("")["input_ids"] == []  # no BOS: empty text is no token at all
    for prompt in ("", torch.zeros(1, 0, dtype=torch.long)):
        for policy in ("h2o", "full"):
            with pytest.raises(ValueError, match="prompt is empty"):
                generate(model, tok, prompt, policy, 8, max_new_tokens=4)


def test_empty_prompt_is_a_value_error_from_model_generate_and_forward():
    model = tiny_model()
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt is empty"):
        _greedy(model, empty, kvevict.make_cache(model, "h2o", 8))
    with torch.no_grad(), pytest.raises(ValueError, match="prompt is empty"):
        model(empty, cache=kvevict.make_cache(model, "h2o", 8))


# (2) a used cache given a new prompt --------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])  # generate drops an all-ones mask: positions tell, or the mask
@pytest.mark.parametrize("new_tokens", [3, 10, 12])  # generate feeds 7 tokens of the new prompt, 1, or nothing
def test_reused_cache_with_a_new_prompt_is_a_value_error(new_tokens, padded):
    model = tiny_model()
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    other = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    cache = kvevict.make_cache(model, "h2o", 64)
    _greedy(model, ids, cache, new_tokens, mask)
    with pytest.raises(ValueError, match=r"new cache \(make_cache\) or call cache.reset\(\)"):
        _greedy(model, other, cache, 4, mask)


def test_reused_cache_after_reset_equals_a_new_cache():
    model = tiny_model()
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    other = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = kvevict.make_cache(model, "h2o", 8)
    _greedy(model, ids, cache, 6)
    cache.reset()
    again = _greedy(model, other, cache, 6)
    fresh = _greedy(model, other, kvevict.make_cache(model, "h2o", 8), 6)
    assert torch.equal(again, fresh)


def test_continuing_the_same_sequence_with_its_cache_still_works():
    """transformers' own way to go on: the whole sequence so far plus new tokens, the same cache;
    with a covering budget exactly what the stock cache does."""
    model = tiny_model()
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    more = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    outs = []
    for make in (lambda: kvevict.make_cache(model, "h2o", 64), lambda: DynamicCache(config=model.config)):
        cache = make()
        first = _greedy(model, ids, cache, 4)
        outs.append(_greedy(model, torch.cat([first, more], 1), cache, 4))
    assert torch.equal(outs[0], outs[1])


def test_a_mask_that_does_not_cover_the_cache_is_a_value_error():
    model = tiny_model()
    cache = kvevict.make_cache(model, "h2o", 64)
    ids = torch.randint(1, 128, (1, 10))
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), cache=cache)
        with pytest.raises(ValueError, match="covers 1 tokens but the cache has seen 10 and this call adds 1"):
            model(ids[:, :1], attention_mask=torch.ones(1, 1, dtype=torch.long), cache=cache)


# (3) past the model's positions -------------------------------------------------------------------


def _short_context_model(n_positions=32):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": n_positions}, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _position_warnings(record):
    return [w for w in record if "more than the model's 32 " in str(w.message)]


def test_prompt_past_the_positions_warns_once_unless_compact():
    model = _short_context_model()
    ids = torch.randint(1, 128, (1, 40))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _greedy(model, ids, kvevict.make_cache(model, "h2o", 16), 4)
    found = _position_warnings(record)
    assert len(found) == 1  # one line for the whole generation, not one per layer or step
    assert "needs 40 positions" in str(found[0].message) and "compact=True" in str(found[0].message)
    # it names the user's line (here _greedy's model.generate), not a frame inside torch or transformers
    assert found[0].filename == __file__
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _greedy(model, ids, kvevict.make_cache(model, "h2o", 16, compact=True), 4)
    assert not _position_warnings(record)


def test_decoding_past_the_positions_warns_when_it_gets_there():
    model = _short_context_model()
    ids = torch.randint(1, 128, (2, 28))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # the padded row never gets as far as the full one
    cache = kvevict.make_cache(model, "h2o", 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _greedy(model, ids, cache, 4, mask)  # positions 0..30: 31 fed, within 32
    assert not _position_warnings(record)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = _greedy(model, ids, kvevict.make_cache(model, "h2o", 16), 6, mask)  # 33 fed
    assert out.shape[1] == 34 and len(_position_warnings(record)) == 1


def test_kvevict_generate_warns_before_the_prefill():
    model, tok = _short_context_model(), char_tokenizer()
    for policy in ("h2o", "full"):
        with pytest.warns(UserWarning, match=r"needs 43 positions, more than the model's 32 ") as record:
            generate(model, tok, "x" * 40, policy, 16, max_new_tokens=4)
        assert len(_position_warnings(record)) == 1 and _position_warnings(record)[0].filename == __file__
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        generate(model, tok, "x" * 40, "h2o", 16, max_new_tokens=4, compact=True)
        generate(model, tok, "x" * 20, "h2o", 16, max_new_tokens=4)
    assert not _position_warnings(record)
