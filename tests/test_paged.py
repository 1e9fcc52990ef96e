"""Paged storage: a cache allocates whole pages as its sequences grow, never past the budget, so it
never holds more than the stock cache would for the same tokens plus one page per (layer, KV head)
and its bookkeeping. The bounds below are exact by design (kvevict.storage.page_slots)."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.storage import PAGE, Storage, page_slots

H, D = 2, 8  # llama-gqa: 2 KV heads of 8 dims, 3 layers


def _stock_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def _expected(cache, tokens: int, batch: int, kv_bits, stats_bytes: int, paged: bool = False) -> int:
    """Per layer page_slots(tokens, budget) slots of (key + value + position + statistics),
    plus each row's count of real tokens (int64) and, rotated, its key centre. Paged (``kvevict.storage.paged``): each row's own pages
    of each of the three per-slot tensors (K/V, position, statistic), whole pages of min(tokens,
    budget) slots, and a page table (int64) per tensor and row."""
    storage = Storage(kv_bits=kv_bits, group=8)
    slot, row = storage.slot_bytes(D, D, 4, stats_bytes), storage.row_bytes(H, D) + 8  # key centre, count
    if paged:
        return sum(
            batch * H * -(-min(tokens, layer.budget) // PAGE) * PAGE * slot
            + row * batch
            + 3 * batch * -(-page_slots(tokens, layer.budget) // PAGE) * 8
            for layer in cache.layers
        )
    return sum(batch * H * page_slots(tokens, layer.budget) * slot + row * batch for layer in cache.layers)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("budget", [1024, 40, 0.5])
@pytest.mark.parametrize("kv_bits", [None, 4])
def test_bytes_are_exact_at_every_length_and_within_a_page_of_the_stock_cache(budget, kv_bits, paged):
    from kvevict.storage import Pools

    model = tiny_model("llama-gqa")
    for prompt in (5, 33, 70):
        ids = torch.randint(0, 128, (2, prompt))
        cache = kvevict.make_cache(model, "h2o", budget, kv_bits=kv_bits, group=8, pages=Pools() if paged else None)
        stock = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True)
            model(ids, cache=stock, use_cache=True)
            for step in range(40):
                tokens = prompt + step
                held = cache.kv_bytes()
                assert held == _expected(cache, tokens, 2, kv_bits, stats_bytes=2, paged=paged)
                # the bound: the stock cache's bytes + one page per (layer, KV head) + bookkeeping
                page = 3 * 2 * H * (PAGE - 1) * 2 * D * 4
                per_slot_book = 2 + 2  # position (int16; -1: empty), H2O's statistic (float16)
                book = 3 * 2 * H * (tokens + PAGE - 1) * per_slot_book + 3 * 2 * (
                    8 + Storage(kv_bits=kv_bits).row_bytes(H, D)
                )
                book += 3 * 3 * 2 * -(-tokens // PAGE) * 8 if paged else 0  # a page table per tensor and row
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
    assert (hi.capacity, lo.capacity) == (16, page_slots(50 - 16, 1000)) == (16, PAGE * 2)


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_padding_takes_no_slot_a_short_row_holds_its_own_tokens(kv_bits):
    """Prompts of 10 and 40 tokens prefilled together (left-padded, as the server and generate
    batch them): the short row's 30 pads are never stored, so it holds its 10 tokens in slots 0-9,
    as alone, and writes its next token at slot 10, not 40."""
    model = tiny_model("llama-gqa")
    torch.manual_seed(0)
    short, long_ = torch.randint(1, 128, (10,)), torch.randint(1, 128, (40,))
    ids, mask, pos = _left_padded([short, long_])
    cache = kvevict.make_cache(model, "h2o", 512, kv_bits=kv_bits, group=8)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        tiers = [layer.tiers[0] for layer in cache.layers]
        assert all(t.row_fills == [10, 40] and t.capacity == page_slots(40, 512) for t in tiers)
        for t in tiers:
            assert torch.equal(t.pos[0, :, :10], torch.arange(10).expand(H, 10))
            assert (t.pos[0, :, 10:] == -1).all() and torch.equal(t.pos[1, :, :40], torch.arange(40).expand(H, 40))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        model(
            nxt,
            attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
            position_ids=torch.tensor([[10], [40]]),
            cache=cache,
            use_cache=True,
        )
        assert all(t.row_fills == [11, 41] and int(t.pos[0, 0, 10]) == 10 for t in tiers)
        alone = kvevict.make_cache(model, "h2o", 512, kv_bits=kv_bits, group=8)
        want = model(short[None], cache=alone, use_cache=True).logits[0, -1]
    assert torch.allclose(out.logits[0, -1], want, atol=1e-5)


def test_padding_is_stored_when_no_slot_past_a_rows_tokens_is_free():
    """Rows at different fills (one joined with a longer history): a chunk whose padding could only
    go past the pages its tokens need is stored as it comes, pads as empty slots, never over a token."""
    model = tiny_model("llama-gqa")
    a, b = (kvevict.make_cache(model, "h2o", 512) for _ in range(2))
    m = 40
    with torch.no_grad():
        model(torch.randint(1, 128, (1, PAGE - 2)), cache=a, use_cache=True)
        model(torch.randint(1, 128, (1, 1)), cache=b, use_cache=True)
        a.append_rows(b)  # fills PAGE - 2 and 1
        mask = torch.ones(2, PAGE - 2 + m, dtype=torch.long)
        mask[1, : PAGE - 3] = 0  # b's history is left padding of the shared rectangle
        mask[0, PAGE - 2 : -2] = 0  # a's chunk: 2 tokens after 38 pads; b's: 31 after 9
        mask[1, PAGE - 2 : PAGE - 2 + 9] = 0
        pos = torch.stack(
            [
                torch.full((m,), PAGE - 2).index_put((torch.tensor([m - 1]),), torch.tensor(PAGE - 1)),
                torch.cat([torch.ones(9, dtype=torch.long), torch.arange(1, 32)]),
            ]
        )
        model(torch.randint(1, 128, (2, m)), attention_mask=mask, position_ids=pos, cache=a, use_cache=True)
    for layer in a.layers:
        t = layer.tiers[0]
        assert t.row_fills == [PAGE - 2 + m, 1 + m]  # the pads took slots (empty ones)
        for row in range(2):
            assert sorted(p for p in t.pos[row, 0].tolist() if p >= 0) == list(range(PAGE))  # no token lost
        assert t.pos[1, 0, 1:10].tolist() == [-1] * 9


def test_padding_beside_a_row_without_room_never_overwrites_a_token():
    """Rows of budgets 64 and 8 in one cache, a padded chunk that the budget-8 row cannot append:
    the chunk takes the ranking path, so the padding is stored (ranked first to go) and counted in
    the budget-64 row's fill: once the other row leaves, its next tokens are appended past every
    token it holds, never over one."""
    model = tiny_model("llama-gqa")
    a, b = kvevict.make_cache(model, "h2o", 64), kvevict.make_cache(model, "h2o", 8)
    with torch.no_grad():
        for c in (a, b):
            model(torch.randint(1, 128, (1, 5)), cache=c, use_cache=True)
        a.append_rows(b)  # caps 64 and 8
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[0, 5:7] = 0  # a: 2 pads, then 4 tokens; b: 6 tokens (past its 8 slots)
        pos = torch.tensor([[5, 5, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10]])
        model(torch.randint(1, 128, (2, 6)), attention_mask=mask, position_ids=pos, cache=a, use_cache=True)
        for layer in a.layers:
            assert all(sum(p >= 0 for p in layer.tiers[0].pos[1, h].tolist()) == 8 for h in range(H))  # b's budget
        a.batch_select_indices(torch.tensor([0]))  # b leaves: a appends at its own fill again
        for step in range(3):
            model(
                torch.randint(1, 128, (1, 1)),
                attention_mask=torch.ones(1, 12 + step, dtype=torch.long),
                position_ids=torch.tensor([[9 + step]]),
                cache=a,
                use_cache=True,
            )
    for layer in a.layers:
        t = layer.tiers[0]
        for h in range(H):
            assert sorted(p for p in t.pos[0, h].tolist() if p >= 0) == list(range(12))  # every token of a
