"""The storage interface is declared once (kvevict.storage.interface) and both implementations,
rectangles and per-row pages, satisfy it; statistics are declared once (kvevict.stats)."""

from dataclasses import dataclass

import pytest
import torch

import kvevict
from kvevict.policies import Policy
from kvevict.stats import FUSED_CANNOT, STATS, stat_bytes
from kvevict.storage import Pools, SlotField, SlotStore
from kvevict.storage.paged import PagedField, PagedStore
from kvevict.storage.rect import RectField, make_store
from kvevict.tier import Tier


@pytest.mark.parametrize("bits", [None, 16, 8, 4, 2])
def test_every_store_is_a_slot_store(bits):
    rect = make_store(2, 2, 4, 32, 32, torch.float32, "cpu", bits, 32)
    paged = PagedStore(
        Pools(), 2, 2, 32, 32, torch.float16 if bits == 16 else torch.float32, torch.float32, "cpu", bits, 32
    )
    assert isinstance(rect, SlotStore) and isinstance(paged, SlotStore)


def test_every_field_is_a_slot_field_and_a_tier_holds_them():
    assert isinstance(RectField(torch.zeros(1, 1, 4), -1), SlotField)
    assert isinstance(PagedField(Pools(), 1, 1, torch.int16, -1, "cpu"), SlotField)
    for pools in (None, Pools()):
        tier = Tier(8, 1, 2, 32, 32, torch.float32, "cpu", ("sum", "sq"), bits=4, pools=pools)
        assert isinstance(tier.store, SlotStore)
        assert all(isinstance(f, SlotField) for f in tier.bookkeeping.values())


def test_every_policy_reads_declared_statistics_and_their_bytes_follow_the_declaration():
    for cls in set(kvevict.POLICIES.values()):
        assert set(cls.stats) <= set(STATS), cls
    assert stat_bytes(("sum", "sq")) == STATS["sum"].dtype.itemsize + STATS["sq"].dtype.itemsize == 6
    assert FUSED_CANNOT == {"max", "expected", "blocks"}


def test_a_policy_naming_an_undeclared_statistic_fails_where_it_is_defined():
    with pytest.raises(ValueError, match="unknown statistic 'entropy'.*kvevict.stats"):

        @dataclass
        class Entropy(Policy):
            stats = ("entropy",)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_rectangle_writes_slots_bit_for_bit_where_taken(dtype):
    """16-bit stores are written through an int16 view of their bytes (torch's CPU scatter_
    copies a float16 tensor whole): the slots written and the ones left must be exactly as told."""
    from kvevict.storage.rect import scatter

    gen = torch.Generator().manual_seed(0)
    store = torch.randn(2, 3, 7, 8, generator=gen).to(dtype)
    src = (torch.randn(2, 3, 2, 8, generator=gen) * 300).to(dtype)  # outlier-sized values too
    idx = torch.tensor([[[1, 5], [0, 6], [2, 3]], [[4, 0], [6, 1], [5, 2]]])
    take = torch.tensor([[[True, False], [True, True], [False, True]], [[True, True], [False, False], [True, False]]])
    want = store.clone()
    for b in range(2):
        for h in range(3):
            for j in range(2):
                if take[b, h, j]:
                    want[b, h, idx[b, h, j]] = src[b, h, j]
    scatter(store, idx, src, take)
    assert store.dtype == dtype and torch.equal(store.view(-1), want.view(-1))
    scatter(store, idx, src)
    assert torch.equal(store[0, 0, 5], src[0, 0, 1]) and torch.equal(store[1, 1, 6], src[1, 1, 0])
