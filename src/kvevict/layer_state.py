"""An eviction layer's state, grouped by what owns it: what the layer was asked for (``LayerSpec``,
what ``reset`` starts again from), what its first forward fixed (``LayerShape``), the host-side
counts of what went through it (``Progress``), one forward's hand-off between update and attention
(``Handoff``) and the per-row state besides the tiers, declared once (``PER_ROW``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .policies import Policy
from .storage import Storage
from .storage.layout import POS16_MAX


@dataclass
class LayerSpec:
    """What a layer was made with. ``storage`` may be replaced by a memory plan's choice at the
    first forward (a short prompt kept at 16 bits), and ``prompt_len`` is set when the prompt's
    length is known before the first forward (chunked prefill); a reset keeps both."""

    policy: Policy
    budget: Any  # tokens, a fraction of the prompt, or a memory plan (``kvevict.memory``)
    layer_idx: int
    inv_freq: torch.Tensor | None = None  # compact positions' RoPE frequencies, or None
    storage: Storage | None = None
    window: int | None = None  # a sliding-window layer's ``sliding_window`` (None: global attention)
    pools: Any = None  # a kvevict.storage.Pools: each row its own pages of a shared pool (None: rectangles)
    slack: int | None = None  # batch eviction; None: ``budget.default_slack`` of the layer's budget
    prompt_len: int | None = None
    memory_plan: bool = False  # the budget was a memory plan's share (``kvevict.memory``)
    floor: int = 0  # the fewest tokens that plan keeps (``MemoryPlan.floor``)


@dataclass
class LayerShape:
    """What the first forward fixed: the model's dtype and device, (KV heads, key and value
    widths), the heads sharing one row of slots (Ada-KV's pool, else 1), the tokens kept per
    (sequence, KV head) and the slots a memory plan gave up for a recent tier."""

    dtype: torch.dtype
    device: torch.device
    dims: tuple[int, int, int]
    shared: int
    budget: int
    recent_cost: int = 0


# the counts a compiled step advances on the device, in ``Progress.owed``'s order
OWED = ("seen", "longest", "evicted")


@dataclass
class Progress:
    """Host-side counts: tokens given (padding included), the most real tokens any row holds (an
    upper bound on the host: exact when read, above it by the padding fed since), tokens that left
    the first tier per (sequence, head), and the most key/value entries held at once.

    A compiled step (``torch.compile``) counts on the device instead, in ``owed``: a captured graph
    that wrote a host int would take it as an input, and CUDA graphs record one graph per value of
    an int input, so one every step. The next eager forward folds ``owed`` into the host counts; a
    read in between adds it (``count``: one host read), leaving the host counts, which compiled
    steps read as constants, as they are."""

    seen: int = 0
    longest: int = 0
    evicted: int = 0
    peak_entries: int = 0
    owed: torch.Tensor | None = None  # (3,) int64 on the layer's device, OWED's order
    pending: bool = False  # compiled steps counted in ``owed`` since the last fold

    def advance(self, m: int, evicted: int, device: torch.device) -> None:
        """A forward's ``m`` entries (padding included), ``evicted`` of them leaving the first tier."""
        if torch.compiler.is_compiling():
            step = torch.tensor((m, m, evicted), dtype=torch.long, device=device)
            if self.owed is None:  # a compiled first forward (the prompt): the counts start here
                self.owed = step
            else:
                self.owed.add_(step)
            self.pending = True
            return
        self.fold()
        if self.owed is None:
            self.owed = torch.zeros(len(OWED), dtype=torch.long, device=device)
        self.seen += m
        self.longest += m
        self.evicted += evicted

    def fold(self) -> None:
        """Add what compiled steps counted to the host counts (one host read), before an eager write."""
        if not self.pending:
            return
        assert self.owed is not None, "pending counts live in owed"
        for name, n in zip(OWED, self.owed.tolist()):
            setattr(self, name, getattr(self, name) + n)
        self.owed.zero_()
        self.pending = False

    def count(self, name: str) -> int:
        """The count ``name`` now: the host's, plus what compiled steps counted since (a host read)."""
        n = getattr(self, name)
        if self.pending and name in OWED:
            assert self.owed is not None, "pending counts live in owed"
            n += int(self.owed[OWED.index(name)])
        return n

    def mask_seen(self) -> int:
        """Tokens seen, for mask sizes. Compiled, the host's count (its compiled steps apart): a
        constant of the graph, as StaticLayer's max_cache_len is; ``kvevict_mask``, its only
        reader, checks nothing there."""
        return self.seen if torch.compiler.is_compiling() else self.count("seen")

    def seq_length(self):
        """Tokens seen; compiled, a 0-d tensor (as StaticLayer's), the device's steps included."""
        if torch.compiler.is_compiling() and self.owed is not None:
            return self.owed[0] + self.seen
        return self.count("seen")

    def fit_positions(self, tiers: list, n_real: torch.Tensor) -> None:
        """Widen ``tiers``' positions to int32 once a row's own last position passes 32,767
        (``n_real`` and ``longest`` already count this step's tokens). ``longest`` bounds it on the
        host (every new entry counted, padding included); the exact count is read from the device
        only when that bound would widen, so neither padding nor a history that outlived its rows
        (``seen``) widens, and decoding far from the limit reads nothing. Compiled, nothing:
        ``capture.prepare`` widened them beforehand where the model's positions can pass int16's."""
        if torch.compiler.is_compiling() or self.longest - 1 <= POS16_MAX:
            return
        if all(t.pos_dtype != torch.int16 for t in tiers):
            return
        self.longest = int(n_real.max())  # near the limit: one host read, then the bound is exact
        for tier in tiers:
            tier.widen_positions(self.longest - 1)

    def skip(self, m: int) -> None:
        """``m`` tokens passed without being stored: seen, counted in the positions, evicted."""
        self.fold()
        self.seen += m
        self.longest += m
        self.evicted += m

    def join(self, other: "Progress") -> None:
        """Rows of ``other`` appended: the longer history, the larger counts."""
        self.fold()
        other.fold()
        for name in ("seen", "longest", "evicted", "peak_entries"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))


@dataclass
class Handoff:
    """One forward's keys and values from ``update`` until ``absorb`` stores them, the stand-in
    keys handed back (attention checks it gets these), the query heads per KV head (once a forward
    has shown its queries), and the last decode step's positions check, read by the next forward."""

    new: tuple[torch.Tensor, torch.Tensor] | None = None
    returned_keys: torch.Tensor | None = None
    group: int | None = None
    position_check: Any = None


@functools.lru_cache(maxsize=16)
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero made once per dtype and device: the shape-only stand-ins expand it, so a decode step
    launches nothing for them."""
    return torch.zeros((), dtype=dtype, device=device)


def stand_ins(key_states: torch.Tensor, value_states: torch.Tensor, held: int) -> tuple:
    """Shape-only keys and values (b, h, held, d) that ``update`` hands back where attention reads
    the tiers itself (every element zero, nothing stored). Traced (``torch.compile``), zeros made in
    the graph: dynamo does not trace through an lru_cache."""
    b, h, _, dk = key_states.shape
    if torch.compiler.is_compiling():
        zk, zv = key_states.new_zeros(()), value_states.new_zeros(())
    else:
        zk, zv = _zero(key_states.dtype, key_states.device), _zero(value_states.dtype, value_states.device)
    return zk.expand(b, h, held, dk), zv.expand(b, h, held, value_states.shape[-1])


class RowTensor:
    """A per-row tensor (b, ...) as a holder of the registry: selected with the batch, concatenated
    when rows join, its bytes counted."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def map_batch(self, fn) -> None:
        self.t = fn(self.t)

    def tensors(self) -> list:
        return [self.t]

    def nbytes(self) -> int:
        return self.t.nbytes


# The per-row state besides the tiers, in one order, with whether its bytes are the cache's (a
# row's policy kind is bookkeeping of the batch, not of the tokens): each holder maps its rows
# (``map_batch``), hands its tensors in that order when rows join (``tensors``), counts ``nbytes``.
PER_ROW = (("_n_real", True), ("_prompt_end", True), ("rows", False), ("summary", True), ("keyspace", True))
