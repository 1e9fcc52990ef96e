"""transformers' own chunked prefill (generate's prefill_chunk_size) is block prefill: the same kept sets as kvevict.prefill(mode="block"), with int and float budgets."""

import math

import pytest
import torch

import kvevict
from conftest import tiny_model

N = 203  # not a multiple of the stride: the last chunk is partial


def _kept(cache):
    """Per layer, the kept positions of every (sequence, KV head), sorted."""
    return [torch.where(layer.valid, layer.pos, -1).sort(-1).values for layer in cache.layers]


def _generate(model, ids, cache, **kw):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )


@pytest.mark.parametrize("policy", ["h2o", "tova", "roco"])
@pytest.mark.parametrize("budget", [40, 0.2])
@pytest.mark.parametrize("stride", [16, 50])
def test_generate_prefill_chunk_size_keeps_what_block_prefill_keeps(policy, budget, stride):
    model = tiny_model("llama-gqa")
    ids = torch.randint(1, 128, (1, N), generator=torch.Generator().manual_seed(3))
    native = kvevict.make_cache(model, policy, budget)
    if isinstance(budget, float):
        native.set_prompt_length(N)
    out_native = _generate(model, ids, native, prefill_chunk_size=stride)
    ours = kvevict.make_cache(model, policy, budget)
    kvevict.prefill(model, ours, ids, mode="block", stride=stride)
    out_ours = _generate(model, ids, ours)
    expected_budget = budget if isinstance(budget, int) else math.ceil(budget * N)
    assert native.budget == ours.budget == expected_budget  # 0.2 of 203 tokens: 41, not 0.2 of a chunk
    assert torch.equal(out_native, out_ours)
    for a, b in zip(_kept(native), _kept(ours)):
        assert torch.equal(a, b)
    assert native.peak_entries() == ours.peak_entries() <= expected_budget + stride
    assert native.get_seq_length() == N + 5  # the 6th new token is not fed back


def test_float_budget_fed_in_chunks_without_the_prompt_length_is_a_clear_error():
    model = tiny_model("llama-gqa")
    ids = torch.randint(1, 128, (1, 100))
    cache = kvevict.make_cache(model, "h2o", 0.2)
    with pytest.raises(ValueError, match=r"first 32-token chunk.*set_prompt_length\(input_ids.shape\[1\]\)"):
        _generate(model, ids, cache, prefill_chunk_size=32)


def test_float_budget_prompt_in_one_forward_then_decoding_then_a_new_turn():
    """A new multi-token turn after decoding is not a chunked prompt: no error, the budget stays."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(1, 128, (1, 50))
    cache = kvevict.make_cache(model, "h2o", 0.2)
    out = _generate(model, ids, cache)
    turn = torch.cat([out, torch.randint(1, 128, (1, 20))], 1)
    _generate(model, turn, cache)
    assert cache.budget == 10 and cache.get_seq_length() == 50 + 5 + 1 + 20 + 5


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_prompt_length(bad):
    cache = kvevict.make_cache(tiny_model("llama-gqa"), "h2o", 0.2)
    with pytest.raises(ValueError, match="prompt length must be a positive int"):
        cache.set_prompt_length(bad)
