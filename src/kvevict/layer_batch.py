"""How an eviction layer's batch changes (``BatchChanges``, a part of ``EvictingLayer``): rows
selected, reordered or repeated (beam search, a server's finished rows leaving) and rows of another
layer appended (continuous batching). Every per-row tensor goes through one function, the tiers'
first and then the registry's (``layer_state.PER_ROW``), in one order: appending concatenates in
that same order, so no row's state can cross to another's."""

from __future__ import annotations

import torch

from . import capture
from .layer_state import LayerShape, Progress, RowTensor
from .merge import Summary
from .rope import CompactPositions
from .rows import Rows, shareable
from .storage import Storage
from .tier import Tier


class BatchChanges:
    """The batch-changing half of ``EvictingLayer`` (transformers' ``reorder_cache``,
    ``batch_repeat_interleave``, ``batch_select_indices``, and kvevict's ``append_rows``)."""

    # the layer's state these methods change (``EvictingLayer`` holds it)
    tiers: list[Tier]
    rows: Rows | None
    progress: Progress
    is_initialized: bool
    compact: CompactPositions | None
    summary: Summary | None
    _prompt_end: RowTensor | None
    _padded: bool
    is_compileable: bool
    wide_positions: bool

    def _per_row(self) -> list:
        raise NotImplementedError

    def _fixed(self) -> LayerShape:
        raise NotImplementedError

    def _expose(self) -> None:
        raise NotImplementedError

    @property
    def n_real(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def prompt_end(self) -> torch.Tensor | None:
        raise NotImplementedError

    storage: Storage
    shared: int
    dims: tuple
    dtype: torch.dtype
    device: torch.device
    pools: object

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.progress.fold()
        for tier in self.tiers:
            tier.settle()
        if any(t.holes for t in self.tiers):
            # slots a turn-over freed stay empty below the rows' fills, no longer handed out in
            # order: from now on the layer masks and checks its slots as a padded batch does
            self._padded = True
        for tier in self.tiers:
            tier.map_batch(fn)
            tier.fit()  # rows with the widest budget may have left: storage narrows to the rest's
        for holder, _ in self._per_row():  # the registry's order: append_rows concatenates in it
            holder.map_batch(fn)
        assert self.rows is not None
        wanted = set(self.rows.stats)
        for tier in self.tiers:  # statistics only the rows that left read: dropped with them
            tier.keep_stats(wanted)
        self._fixed().budget = self.tiers[0].budget // self.shared
        if any(t.pos_dtype != torch.int16 for t in self.tiers) and not self.wide_positions:
            # the rows past 32,767 may have left: back to int16 once every row's positions fit (one
            # host read per batch change of a widened batch), so no row pays for one that left
            self.progress.longest = int(self.n_real.max()) if self.n_real.numel() else 0
            for tier in self.tiers:
                tier.narrow_positions(self.progress.longest - 1)
        self._expose()
        if self.is_compileable:  # the rows' new tensors, at static addresses again
            capture.prepare(self)

    def reorder_cache(self, beam_idx) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._map_batch(lambda t: t[indices])

    def can_append(self, other: "BatchChanges") -> bool:
        return (
            self.is_initialized
            and other.is_initialized
            and self.storage == other.storage
            and self.dims == other.dims
            and self.dtype == other.dtype
            and len(self.tiers) == len(other.tiers)
            and self.shared == other.shared
            and self.compact is None
            and other.compact is None
            and self.pools is other.pools
            and (self.summary is None) == (other.summary is None)
            and self.rows is not None
            and other.rows is not None
            and shareable(self.rows.policies + other.rows.policies)
        )

    def append_rows(self, other: "BatchChanges") -> None:
        """Append ``other``'s sequences (same storage; any policies and budgets ``can_append``
        accepts) after this layer's, for continuous batching. Rows may be at different fill
        levels: a row's slots past its own fill are empty (invalid, priority -inf), so its next
        tokens take them before anything of it is evicted, exactly as alone. Rows may have
        different budgets: each tier becomes as wide as the wider of the two, and a row's slots
        past its own budget stay unavailable (``Tier.caps``); each row evicts by its own policy
        (``rows.Rows``). ``seen`` becomes the longer history: the caller left-pads the shorter
        rows' attention masks to it."""
        for tier in (*self.tiers, *other.tiers):  # waiting tokens to their slots before any tier widens
            tier.settle()
        for mine, their in zip(self.tiers, other.tiers):
            names = tuple(dict.fromkeys((*mine.stat_names, *their.stat_names)))
            width = max(mine.budget, their.budget)
            mine.widen(width, names)
            their.widen(width, names)
            for a, z in ((mine, their), (their, mine)):  # one position dtype: the wider
                a.widen_positions(torch.iinfo(z.pos_dtype).max)
            slots = max(mine.capacity, their.capacity)  # one rectangle: the fuller one's pages
            mine.grow_to(slots)
            their.grow_to(slots)
            if mine.caps is not None or their.caps is not None:  # both carry caps, so they concatenate
                mine.caps, their.caps = mine.row_caps(), their.row_caps()
        if (self.prompt_end is None) != (other.prompt_end is None):  # a question's end: 0 for rows without one
            for layer in (self, other):
                if layer._prompt_end is None:
                    ends = torch.zeros(layer.n_real.shape[0], 1, 1, dtype=torch.long, device=self.device)
                    layer._prompt_end = RowTensor(ends)
        assert self.rows is not None and other.rows is not None
        self.rows.adopt(other.rows)
        theirs: list[torch.Tensor] = []

        def collect(t):
            theirs.append(t)
            return t

        for tier in other.tiers:  # every per-row tensor, in _map_batch's order: the tiers', then the registry's
            tier.map_batch(collect)
        rows = iter([*theirs, *(t for holder, _ in other._per_row() for t in holder.tensors())])
        self.progress.join(other.progress)
        self._map_batch(lambda t: torch.cat([t, next(rows)]))
        for tier in other.tiers:  # paged: their rows' pages are this cache's now (a rectangle: copied)
            tier.disown()
        # rows of different fills: slots below ``filled`` that a row has not used are empty, masked
        self._padded = self._padded or any(len(set(t.row_fills)) > 1 for t in self.tiers)
        self._padded = self._padded or other._padded or any(t.caps is not None for t in self.tiers)
