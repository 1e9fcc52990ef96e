"""The storage layout (``kvevict.storage.layout``) is what a tier's bytes are counted by: it must be
exactly the bytes of the tensors the tier holds, through every change a cache goes through
(growth, eviction in batches, rows leaving and joining, int32 positions), rectangles and pages,
every storage, pooled heads, a low-bit second tier and a recent tier."""

import pytest
import torch

import kvevict
from conftest import tiny_model
from kvevict.storage import Pools, Storage
from kvevict.storage.layout import POS16_MAX, TABLE_BYTES, SlotLayout


def _measured(tier) -> int:
    """The bytes of every tensor the tier holds (its recent tier's included)."""
    own = tier.store.nbytes() + sum(f.nbytes() for f in tier.bookkeeping.values())
    return own + (0 if tier.recent is None else _measured(tier.recent))


def _check(cache) -> None:
    tiers = [t for layer in cache.layers if layer.is_initialized for t in layer.tiers]
    assert tiers
    for t in tiers:
        assert t.nbytes() == _measured(t), (t.layout, t.capacity, t.row_fills)


SPECS = ["h2o@40", "h2o/int4@40+slack=4", "snapkv/int8+int2@24", "ada-snapkv/int4@40", "tova/fp16@40", "h2o/int2@40"]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("spec", SPECS)
def test_a_tiers_counted_bytes_are_the_bytes_of_its_tensors(spec, paged):
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (3, 30))
    cache = kvevict.make_cache(model, spec, group=8, pages=Pools() if paged else None)
    with torch.no_grad():
        tok = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        _check(cache)
        for _ in range(25):  # past the budget: evictions, in batches where the spec says so
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            _check(cache)
        cache.batch_select_indices(torch.tensor([0, 2]))  # a row leaves
        _check(cache)
        other = kvevict.make_cache(model, spec, group=8, pages=cache.layers[0].pools)
        model(torch.randint(0, 128, (1, 12)), cache=other, use_cache=True)
        if cache.layers[0].can_append(other.layers[0]):  # a row joins at another fill
            cache.append_rows(other)
            _check(cache)
        for tier in (t for layer in cache.layers for t in layer.tiers):
            tier.widen_positions(POS16_MAX + 1)  # a row past 32,767 tokens: int32 positions
        _check(cache)


def test_the_layout_spells_out_a_slot_and_a_page_table():
    int4 = SlotLayout(64, 64, bits=4, group=32, stats=("sum",), pooled=True, page=32)
    # 32 bytes of codes and 2 x (step + zero) per 32 channels, for keys and values; int16
    # position; float16 sum; the head id
    assert int4.kv_bytes == 2 * (32 + 2 * 2)
    assert int4.slot_bytes() == 72 + 2 + 2 + 1
    assert int4.slot_bytes(torch.int32) == 72 + 4 + 2 + 1
    assert int4.tensors == 4  # keys and values, positions, head ids, sum
    assert int4.table_bytes(rows=3, columns=5) == 3 * 5 * TABLE_BYTES * 4
    assert SlotLayout(64, 64).table_bytes(3, 5) == 0  # a rectangle has no table
    assert SlotLayout(64, 64, dtype_bytes=4).kv_bytes == 2 * 64 * 4
    # what a plan counts per slot before any tensor exists reads the same layout
    assert Storage(kv_bits=4).slot_bytes(64, 64, 2, 3) == int4.slot_bytes()
