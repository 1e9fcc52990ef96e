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
