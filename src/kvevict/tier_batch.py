"""How a tier's batch changes (``TierBatch``, a part of ``Tier``): rows selected, reordered, repeated
or appended (``map_batch``, then ``fit``), and rows of budgets of their own (``caps``, ``widen``):
a batch is as wide as its widest row, a row's slots past its own cap are never written or ranked
(``kvevict.caps``), and pages no row uses any more go back."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .caps import RowCaps
from .stats import stat_dtype
from .storage.layout import SlotLayout
from .storage.paged import page_slots


class TierBatch:
    """The batch-changing half of ``Tier``."""

    # the tier's state these methods change (``Tier`` holds it)
    budget: int
    capacity: int
    filled: int
    row_fills: list[int]
    row_fills_dev: torch.Tensor
    device: torch.device
    layout: SlotLayout
    store: Any
    _meta: dict
    _caps: RowCaps | None

    def settle(self) -> None:
        raise NotImplementedError

    def names(self) -> tuple:
        raise NotImplementedError

    def set_fills(self, fills: list[int]) -> None:
        raise NotImplementedError

    def _field(self, b, dtype, empty):
        raise NotImplementedError

    def _resize(self, n: int) -> None:
        raise NotImplementedError

    def map_batch(self, fn) -> None:
        """Apply ``fn`` to every per-row tensor (slots, then each row's fill and cap); ``fit`` after.
        Slots a batch eviction freed stay empty (ranked first to be taken) but are no longer handed
        out in order: rows that join may be at another step of their turn-over."""
        self.settle()
        self._map_slots(fn)
        self.row_fills_dev = fn(self.row_fills_dev)
        if self.caps is not None:
            self._caps = RowCaps(fn(self.caps))

    def _map_slots(self, fn, store: bool = True) -> None:
        if store:
            self.store.map_batch(fn)
        for name in self.names():  # positions, head ids, then the statistics
            self._meta[name].map_batch(fn)

    @property
    def caps(self) -> torch.Tensor | None:
        """(b,) each row's own number of slots (``kvevict.caps``), or None: every row has the budget."""
        return None if self._caps is None else self._caps.tensor

    @caps.setter
    def caps(self, caps: torch.Tensor | None) -> None:
        self._caps = None if caps is None else RowCaps(caps)

    def row_caps(self) -> torch.Tensor:
        """(b,) each row's own number of slots."""
        if self.caps is not None:
            return self.caps
        return torch.full((len(self.row_fills),), self.budget, dtype=torch.long, device=self.device)

    def widen(self, budget: int, stats: tuple) -> None:
        """Take rows of up to ``budget`` slots and carry every statistic in ``stats``, so rows of
        another tier can be appended; each row keeps its own cap. No slot is allocated here: the
        pages come as the rows grow into them."""
        if stats != self.layout.stats:
            for s in stats:
                if s not in self._meta:
                    self._meta[s] = self._field(len(self.row_fills), stat_dtype(s), 0)
            self.layout = replace(self.layout, stats=tuple(stats))
        if budget > self.budget:
            self._caps = RowCaps(self.row_caps())
            self.budget = budget

    def fit(self) -> None:
        """After rows joined or left: pages no row uses any more are given back, the budget is the
        widest row's cap (a row writes only below its cap, so nothing kept is cut), and no caps
        once every row has the full width."""
        self.set_fills(self.row_fills_dev.tolist())  # one host read per batch change, none per step
        keep = page_slots(self.filled, self.budget)
        if keep < self.capacity:  # rows that left held the last pages
            self._resize(keep)
        if self.caps is None:
            return
        widest = int(self.caps.max()) if self.caps.numel() else self.budget
        if widest < self.budget:
            self.budget = widest
            if self.capacity > widest:
                self._resize(widest)
        if (int(self.caps.min()) if self.caps.numel() else self.budget) >= self.budget:
            self._caps = None
            return
        assert self._caps is not None
        self._caps.index()
