"""Paged storage: a cache allocates whole pages as its sequences grow, never past the budget, so it
never holds more than the stock cache would for the same tokens plus one page per (layer, KV head)
and its bookkeeping. The bounds below are exact by design (kvevict.tier.pages)."""

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import kvevict
from kvevict.storage import Storage
from kvevict.tier import PAGE, pages

H, D = 2, 8  # llama-gqa: 2 KV heads of 8 dims, 3 layers


def _stock_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def _expected(cache, tokens: int, batch: int, kv_bits, stats_bytes: int) -> int:
    """Per layer pages(tokens, budget) slots of (key + value + position + statistics),
    plus each row's count of real tokens (int64)."""
    slot = Storage(kv_bits=kv_bits, group=8).slot_bytes(D, D, 4, stats_bytes)
    return sum(batch * H * pages(tokens, layer.budget) * slot + 8 * batch for layer in cache.layers)


@pytest.mark.parametrize("budget", [1024, 40, 0.5])
@pytest.mark.parametrize("kv_bits", [None, 4])
def test_bytes_are_exact_at_every_length_and_within_a_page_of_the_stock_cache(budget, kv_bits):
    model = tiny_model("llama-gqa")
    for prompt in (5, 33, 70):
        ids = torch.randint(0, 128, (2, prompt))
        cache = kvevict.make_cache(model, "h2o", budget, kv_bits=kv_bits, group=8)
        stock = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True)
            model(ids, cache=stock, use_cache=True)
            for step in range(40):
                tokens = prompt + step
                held = cache.kv_bytes()
                assert held == _expected(cache, tokens, 2, kv_bits, stats_bytes=2)
                # the bound: the stock cache's bytes + one page per (layer, KV head) + bookkeeping
                page = 3 * 2 * H * (PAGE - 1) * 2 * D * 4
                per_slot_book = 2 + 2  # position (int16; -1: empty), H2O's statistic (float16)
                book = 3 * 2 * H * (tokens + PAGE - 1) * per_slot_book + 3 * 2 * 8
                assert held <= _stock_bytes(stock) + page + book
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(nxt, cache=cache, use_cache=True)
                model(nxt, cache=stock, use_cache=True)


def test_a_short_chat_under_a_large_budget_holds_its_own_pages_only():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", 1024)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 20)), cache=cache, use_cache=True)
    assert all(t.capacity == PAGE for layer in cache.layers for t in layer.tiers)
    assert all(layer.budget == 1024 for layer in cache.layers)


def test_pages_are_allocated_on_growth_and_given_back_when_a_row_leaves():
    model = tiny_model("llama-gqa")
    long_, short = (kvevict.make_cache(model, "h2o", 512) for _ in range(2))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 3 * PAGE + 5)), cache=long_, use_cache=True)
        model(torch.randint(0, 128, (1, 7)), cache=short, use_cache=True)
    assert long_.layers[0].tiers[0].capacity == 4 * PAGE and short.layers[0].tiers[0].capacity == PAGE
    long_.append_rows(short)  # one rectangle: the longer row's pages
    assert long_.layers[0].tiers[0].capacity == 4 * PAGE
    long_.batch_select_indices(torch.tensor([1]))  # the long row left: its pages go back
    assert all(t.capacity == PAGE for layer in long_.layers for t in layer.tiers)
    # a slot: fp32 K and V, an int16 position and H2O's float16 sum
    assert long_.kv_bytes() == sum(H * PAGE * (2 * D * 4 + 2 + 2) + 8 for _ in long_.layers)


def test_mixed_precision_tiers_grow_in_pages_too():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", 16, kv_bits=8, evicted_bits=4, evicted_budget=1000, group=8)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 50)), cache=cache, use_cache=True)
    hi, lo = cache.layers[0].tiers
    assert (hi.capacity, lo.capacity) == (16, pages(50 - 16, 1000)) == (16, PAGE * 2)
