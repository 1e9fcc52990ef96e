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


@dataclass
class Progress:
    """Host-side counts: tokens given (padding included), the most real tokens any row holds (an
    upper bound on the host: exact when read, above it by the padding fed since), tokens that left
    the first tier per (sequence, head), and the most key/value entries held at once."""

    seen: int = 0
    longest: int = 0
    evicted: int = 0
    peak_entries: int = 0

    def skip(self, m: int) -> None:
        """``m`` tokens passed without being stored: seen, counted in the positions, evicted."""
        self.seen += m
        self.longest += m
        self.evicted += m

    def join(self, other: "Progress") -> None:
        """Rows of ``other`` appended: the longer history, the larger counts."""
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
