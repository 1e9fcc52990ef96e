"""Budgets in bytes: say how much memory the cache may hold, get tokens kept x bits per token.

``make_cache(model, memory=0.2)`` uses it. A memory budget is a fraction m of what a stock
transformers cache would hold for the prompt with 16-bit keys and values (``kvevict.stock``:
sliding-window layers at their window, every other layer at every token), whatever the model's own
dtype (``0.2``, ``"20%"``), or bytes per sequence (``"64MiB"``, ``2**26``). With r_b the bytes of a
b-bit slot over a 16-bit token's (``Storage.slot_bytes``: codes, a step and a zero byte per group,
an int16 position, the policy's statistics), ``plan_memory`` spends m as:

  - m >= r8: every token at int8;
  - r4 <= m < r8: every token kept, the policy's top share f at int8, the rest at int4 (MiKV's
    mixed precision), f r8 + (1 - f) r4 = m;
  - ``HEAD_FROM`` r4 <= m < r4 (a streaming policy): three tiers, the top h at int8 holding
    ``HEAD_BYTES`` of the bytes (h r8 = HEAD_BYTES m), the next g at int4 (g r4 = m - h r8), the
    rest evicted; a prompt-scoring policy (``kvzip-pool``) from ``PROMPT_FROM`` r4 with
    ``PROMPT_HEAD_BYTES``, and int8 alone elsewhere (never int4 alone: per-token int4 keys blur the
    sharp attention a copied needle needs);
  - below: evict, the kept m / r4 tokens at int4. 2-bit storage is never chosen.

A model with sliding-window layers solves its token budget B per layer once the prompt length n
is known (sum_l min(cap_l, B) r = m sum_l kept_l(n)) and keeps one tier below r4: int8 while its
tokens could hold ``GLOBAL_HOLD`` of the global layers' tokens, int4 past that. A fraction never
cuts a short prompt: at least ``MIN_TOKENS`` tokens per layer and KV head. The share is a
``MemoryPlan`` (a ``kvevict.budget.Budget``), resolved once the prompt's length is known.

Which policy a budget picks when none is named: ``kvevict.default_policy``.
A calibrated plan (``kvevict.plans``: the user's own, else one kvevict ships for a known model)
names the kind of storage instead of the rule. Every constant cites the measurement that chose
it: docs/results/memory-rule.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from . import plans
from .budget import Budget
from .default_policy import STREAM_POLICY
from .shape import head_dim_of, text_config
from .stock import STOCK_BYTES, kept_tokens, sliding_windows
from .storage import DEFAULT_GROUP, Storage, stat_bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(memory) -> float | int:
    """0.2 or '20%' -> 0.2 (fraction of a 16-bit stock cache's bytes); '64MiB' or 67108864 -> bytes (int)."""
    if isinstance(memory, bool):
        raise ValueError(
            f"memory must be a fraction in (0, 1], a percentage or a size such as '64MiB', got {memory!r}."
        )
    if isinstance(memory, str):
        text = memory.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                memory = float(text[:-1]) / 100
            except ValueError:
                memory = None
        else:
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
            if m and m.group(2) in _UNITS:
                value = float(m.group(1))
                memory = value if (not m.group(2) and value <= 1 and "." in text) else int(value * _UNITS[m.group(2)])
            else:
                memory = None
        if memory is None:
            raise ValueError(
                f"cannot read the memory budget {text!r}: write a fraction (0.2), a percentage (20%) "
                "or a size (64MiB, 2GiB)."
            )
    if isinstance(memory, float):
        if not 0.0 < memory <= 1.0:
            raise ValueError(
                f"a fractional memory budget is a share of a 16-bit stock cache's bytes, in (0, 1]; got {memory}."
            )
        return memory
    if isinstance(memory, int) and memory > 0:
        return memory
    raise ValueError(f"memory must be a fraction in (0, 1], a percentage or a size such as '64MiB', got {memory!r}.")


MIN_TOKENS = 128  # a fractional memory budget keeps at least this many tokens per layer and KV head
# below r4, a streaming policy's three tiers (int8 top, int4 next, the rest evicted) from this share
# of r4 on, the int8 tier holding this share of the bytes (docs/results/quality-per-byte.md)
HEAD_FROM, HEAD_BYTES = 0.49, 0.28
# MAS ranks by mean attention, so its top share earns int8 further down: three tiers from 5% of a
# 16-bit cache at head_dim 64 (H2O's top, its largest sums, lost there to int4 alone)
HEAD_FROM_OF = {"mas": 0.16}


def head_from(policy) -> float:
    """The share of r4 from which ``policy`` streams in three tiers (``HEAD_FROM`` unless measured)."""
    return HEAD_FROM_OF.get(getattr(policy, "name", policy), HEAD_FROM)


# a prompt-scoring policy's three tiers: from this share of r4 on (10% of a 16-bit cache at head_dim
# 64), the int8 tier holding this share of the bytes (docs/results/ruler.md, docs/results/quality-per-byte.md)
PROMPT_FROM, PROMPT_HEAD_BYTES = 0.34, 0.5
# a sliding model under a prompt-scoring policy, below r4: int8 while its tokens, over all layers,
# could hold this share of the global layers' tokens, else int4 (docs/results/ruler.md, "A second model")
GLOBAL_HOLD = 0.9


def storage_kind(kv_bits=None, evicted_bits=None, evicted_budget=None) -> str | None:
    """The kind of storage ``plan`` spends a memory budget on when the caller names its bits
    (``make_cache(memory=0.2, kv_bits=4)``): "fp16", "int8", "int4", or "int8+int4" for int8 with
    int4 below it; None when no bits are named (the rule decides)."""
    if evicted_budget is not None:
        raise ValueError(
            "a memory budget sizes both tiers itself: leave evicted_budget out, or give a token "
            "budget instead of memory."
        )
    if kv_bits is None and evicted_bits is None:
        return None
    kind = {(16, None): "fp16", (8, None): "int8", (4, None): "int4", (8, 4): "int8+int4"}.get((kv_bits, evicted_bits))
    if kind is None:
        raise ValueError(
            f"a memory budget is spent at kv_bits 16, 8 or 4, or kv_bits=8 with evicted_bits=4; got "
            f"kv_bits={kv_bits}, evicted_bits={evicted_bits}. Leave both out to let the plan choose."
        )
    return kind


LONE_BITS = {"fp16": 16, "int8": 8, "int4": 4}  # a kind of storage that keeps one width of bits


@dataclass(frozen=True, eq=False, repr=False)  # a float's equality, hash and repr: its share
class MemoryPlan(float, Budget):
    """A fractional token budget from a memory plan (``plan_memory``). Its float value ``share`` is
    the share of the prompt kept on a model without sliding layers (what ``check_budget`` and the
    layer schedules read); ``resolve(n)`` solves the bytes for sliding layers, then keeps at least
    ``floor`` tokens (see the module's rule). Once the prompt's length n is known the cache asks
    ``storage_for(n, planned)``: a prompt of at most ``floor`` tokens is kept whole at 16 bits
    (``short_bits``: the model's dtype when it is 16-bit, else float16), where 4-bit codes changed
    SmolLM2's greedy answers to 10 of 13 short chats (fp32).

    memory: the plan's m (a share of a 16-bit stock cache); ratio: r, a slot's bytes over a 16-bit
    token's; windows: per layer the tokens a stock cache keeps at most (None: every one); pair: a
    two-tier plan's (int8 share, int4 share), this one being ``pair[part]``; coarse: a sliding
    model's int4 plan, for prompts its int8 pool cannot hold (``coarser``)."""

    share: float
    memory: float = 0.0
    ratio: float = 1.0
    windows: tuple[int | None, ...] = ()
    floor: int = 1
    short_bits: int | None = 16
    pair: tuple[float, float] | None = None
    part: int = 0
    coarse: MemoryPlan | None = None

    def __new__(cls, share: float, *args, **kwargs):
        return super().__new__(cls, share)  # a float's value is fixed here, the fields by __init__

    def __post_init__(self):
        object.__setattr__(self, "windows", tuple(self.windows))  # frozen: a list given is kept as a tuple

    def coarser(self, n: int) -> bool:
        """Whether an n-token prompt takes the int4 plan (``coarse``): the int8 tokens the bytes buy,
        over all layers, are fewer than ``GLOBAL_HOLD`` of the global layers' n tokens each (see the
        module's rule)."""
        if self.coarse is None or n <= self.floor:
            return False
        b = self._own(n)
        held = sum(b if w is None else min(w, b) for w in self.windows)
        return held < GLOBAL_HOLD * n * sum(w is None for w in self.windows)

    def partner(self) -> MemoryPlan:
        """A two-tier plan's other share (the int4 tier's for the int8 tier's, and back)."""
        assert self.pair is not None, "partner() is a two-tier plan's (pair set)"
        other = 1 - self.part
        return MemoryPlan(
            self.pair[other], self.memory, self.ratio, self.windows, self.floor, self.short_bits, self.pair, other
        )

    def floored(self, n: int) -> bool:
        """A two-tier plan whose tokens for an n-token prompt the floor sets: int4 would buy no token
        more, so the floor's tokens are kept at the first tier's bits alone (int8). Copying a
        passage of 122-204 tokens, three tiers split over the floor's 128 tokens lost 15 BLEU points
        against int8 alone (docs/results/quality-per-byte.md)."""
        if not self.pair:
            return False
        return sum(self.pair) * n <= self.floor

    def storage_for(self, n: int, planned: Storage) -> Storage:
        """The storage for an n-token prompt: ``planned``, 16 bits for a short prompt, the first
        tier alone where the floor sets a two-tier plan's tokens (``floored``), int4 where the int8
        pool is too small (``coarser``)."""
        if n <= self.floor:
            return Storage(kv_bits=self.short_bits, group=planned.group)
        if self.coarser(n):
            return Storage(kv_bits=4, group=planned.group)
        return Storage(kv_bits=planned.kv_bits, group=planned.group) if self.floored(n) else planned

    def resolve(self, prompt_len: int) -> int:
        coarse = self.coarse  # coarser(n) is False without one
        return coarse.resolve(prompt_len) if coarse is not None and self.coarser(prompt_len) else self._own(prompt_len)

    def _own(self, n: int) -> int:
        """This plan's tokens for an n-token prompt (never its ``coarse`` one's)."""
        if n <= self.floor or self.floored(n):  # kept whole, room for the answer up to the floor; or
            return self.floor  # the floor's tokens, in the first tier alone
        if self.pair:  # two tiers: the floor bounds the tokens both keep, split as the plan splits them
            head, tail = self.pair
            total = min(n, max(self.floor, math.ceil((head + tail) * n - 1e-9)))
            first = min(total, max(1, math.ceil(total * head / (head + tail) - 1e-9)))
            return first if self.part == 0 else max(1, total - first)
        budget = math.ceil(self.share * n - 1e-9)
        if any(w is not None for w in self.windows):  # slots the bytes of the stock cache buy, solved for B
            budget = min(n, _fill(self.memory * kept_tokens(list(self.windows), n) / self.ratio, self.windows))
        return max(1, self.floor, budget)


def _fill(units: float, caps) -> int:
    """The largest B with sum_l min(cap_l, B) <= units (cap None: no cap)."""
    lo, hi = 0, int(units) + 1
    while lo < hi:  # sum_l min(cap_l, B) grows with B
        mid = (lo + hi + 1) // 2
        if sum(mid if c is None else min(c, mid) for c in caps) <= units:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Plan:
    budget: float | int  # tokens kept at kv_bits: a fraction of the prompt (a MemoryPlan), or tokens
    storage: Storage


@dataclass(frozen=True)
class SlotShape:
    """What one slot of a (layer, KV head) costs, and how many (layer, KV head) there are.
    ``stats_bytes``: a slot's statistics (``storage.stat_bytes(policy.stats)``); ``dtype_bytes``:
    the model's, for storage kept in it; ``layers_heads``: layers x KV heads, to turn bytes per
    sequence into slots per (layer, KV head); ``slot_extra``: bytes a slot carries besides
    ``Storage.slot_bytes`` (Ada-KV's 1-byte head id); ``windows``: per layer the tokens a stock
    cache keeps at most (``kvevict.stock.stock_windows``), empty for a model without sliding layers."""

    head_dim_k: int
    head_dim_v: int
    dtype_bytes: int
    stats_bytes: int
    layers_heads: int = 1
    group: int = DEFAULT_GROUP
    slot_extra: int = 0
    windows: tuple[int | None, ...] = ()

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def slot(self, bits) -> float:
        """Bytes of one ``bits``-bit slot (codes, a step and a zero byte per group, its position,
        statistics and extras)."""
        st = Storage(kv_bits=bits, group=self.group)
        return st.slot_bytes(self.head_dim_k, self.head_dim_v, self.dtype_bytes, self.stats_bytes) + self.slot_extra

    def ratios(self) -> dict[int, float]:
        """r_b for b in 16, 8, 4: a b-bit slot's bytes over a 16-bit stock token's."""
        full = (self.head_dim_k + self.head_dim_v) * STOCK_BYTES  # one 16-bit token of the stock cache
        return {bits: self.slot(bits) / full for bits in (16, 8, 4)}


@dataclass(frozen=True)
class Spending:
    """How ``plan_memory`` may spend a fractional budget. ``floor``: the fewest tokens it keeps;
    ``scores_prompt``: the policy ranks the whole prompt before decoding (kvzip): three tiers from
    ``PROMPT_FROM`` x r4 to r4, else int8, never int4 alone (see the module's rule); ``kind``: spend
    it this way instead of by the rule ("fp16", "int8", "int4": evict and keep those bits;
    "int8+int4": two tiers, every token from r4, else three), as a calibrated plan file or the
    caller's bits say (``kvevict.eval.calibrate``, ``storage_kind``); ``head_from``: the share of r4
    from which a streaming policy keeps three tiers (``head_from(policy)``); ``planned``: ``kind``
    is a calibrated plan's, measured at a nearby share, so the rule decides where that one kind of
    bits would keep every token with bytes to spare."""

    floor: int = MIN_TOKENS
    scores_prompt: bool = False
    kind: str | None = None
    head_from: float = HEAD_FROM
    planned: bool = False


def plan_memory(memory, shape: SlotShape, spend: Spending | None = None) -> Plan:
    """The storage and token budget for ``memory`` (see the module's rule), as a share of a 16-bit
    stock cache whatever ``shape.dtype_bytes``, or bytes per sequence."""
    spend = spend or Spending()
    memory = parse_memory(memory)
    if isinstance(memory, int):
        return _plan_bytes(memory, shape, spend.kind)
    ratio = shape.ratios()
    kind = spend.kind
    lone = LONE_BITS.get(kind or "")
    if spend.planned and lone is not None and memory > ratio[lone]:  # e.g. a plan's int4 at 20% asked for 50%
        kind = None
    short = None if shape.dtype_bytes == STOCK_BYTES else 16  # a short prompt: 16 bits, the model's own if it has them

    def share(value, bits, **more) -> MemoryPlan:
        return MemoryPlan(min(1.0, value), memory, ratio[bits], shape.windows, spend.floor, short, **more)

    if kind is None and spend.scores_prompt and shape.sliding and memory < ratio[4]:  # int8, int4 for a long prompt
        budget = share(memory / ratio[8], 8, coarse=share(memory / ratio[4], 4))
        return Plan(budget, Storage(kv_bits=8, group=shape.group))
    kind = _rule_kind(kind, memory, ratio, shape.sliding, spend)
    if kind == "int8+int4":
        if memory >= ratio[4]:  # every token: the policy's top f at int8, the rest at int4
            head = (memory - ratio[4]) / (ratio[8] - ratio[4])  # f r8 + (1 - f) r4 = memory
            if head * 1000 < 1:
                return Plan(share(1.0, 4), Storage(kv_bits=4, group=shape.group))
        else:  # the top at int8 in HEAD_BYTES of the memory, as many next at int4 as the rest buys
            head = (PROMPT_HEAD_BYTES if spend.scores_prompt else HEAD_BYTES) * memory / ratio[8]
        pair = (head, (memory - head * ratio[8]) / ratio[4])
        first = MemoryPlan(head, memory, ratio[8], (), spend.floor, short, pair)
        return Plan(first, Storage(kv_bits=8, group=shape.group, evicted_bits=4, evicted_budget=first.partner()))
    bits = LONE_BITS.get(kind or "")
    if bits is None:
        raise ValueError(f"unknown kind of storage {kind!r} in a memory plan: fp16, int8, int4 or int8+int4.")
    return Plan(share(memory / ratio[bits], bits), Storage(kv_bits=bits, group=shape.group))


def _rule_kind(kind: str | None, memory: float, ratio: dict, sliding: bool, spend: Spending) -> str:
    """The kind of storage a fractional ``memory`` is spent on: ``kind`` where named, else the
    module's rule; two tiers only where they apply (not from r8, not below r4 with sliding layers,
    whose three tiers are not solved per layer)."""
    if kind is None and spend.scores_prompt:  # three tiers where measured, else evict at int8 (module's rule)
        kind = "int8+int4" if PROMPT_FROM * ratio[4] <= memory < ratio[4] else "int8"  # a sliding model: above
    if kind is None:
        if memory >= ratio[8]:
            kind = "int8"
        elif memory >= ratio[4] or (memory >= spend.head_from * ratio[4] and not sliding):
            kind = "int8+int4"
        else:
            kind = "int4"
    if kind == "int8+int4" and memory >= ratio[8]:  # int8 for every token fits: no int4 tier
        return "int8"
    if kind == "int8+int4" and memory < ratio[4] and sliding:  # three tiers are not solved per layer
        return "int4"
    return kind


def _plan_bytes(memory: int, shape: SlotShape, kind: str | None) -> Plan:
    """Bytes per sequence: as many int4 tokens as fit per (layer, KV head), or of the bits named; a
    sliding layer never holds more than its window, the rest going to the others."""
    if kind == "int8+int4":
        raise ValueError(
            "two tiers are planned for a fractional memory budget (0.2, '20%'); with bytes per "
            "sequence give one kv_bits."
        )
    bits = {"fp16": 16, "int8": 8}.get(kind or "", 4)
    if shape.sliding:
        tokens = _fill(memory / (shape.layers_heads // len(shape.windows) * shape.slot(bits)), shape.windows)
    else:
        tokens = int(memory // (shape.layers_heads * shape.slot(bits)))
    if tokens < 1:
        raise ValueError(
            f"{memory} bytes hold less than one {bits}-bit token per layer and KV head "
            f"({shape.layers_heads * shape.slot(bits):.0f} bytes); give more memory."
        )
    return Plan(tokens, Storage(kv_bits=bits, group=shape.group))


def plan_for_model(
    model, memory, policy, group: int = DEFAULT_GROUP, floor: int = MIN_TOKENS, plan_file=None, kind: str | None = None
) -> Plan:
    """``plan_memory`` with the model's shape: head dimension, dtype, layers x KV heads, sliding windows,
    the policy's statistics. ``plan_file``: a plan ``kvevict calibrate`` wrote (a path), None for
    the model's own calibrated plan when it has one (``kvevict.plans.default_path``), else the one
    kvevict ships for it (``kvevict.plans.shipped``), False for the built-in rule. A plan applies
    to fractional budgets and to the policy it was calibrated with.
    ``kind``: the storage the caller named (``storage_kind``), over any plan."""
    config = text_config(model)
    d = head_dim_of(model)
    if d is None:
        raise ValueError(f"cannot find the head dimension of {type(model).__name__} to plan a memory budget.")
    layers_heads = config.num_hidden_layers * (
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    )
    head_id = 1 if policy.adaptive else 0  # a pooled slot says whose head it is (Tier.head)
    share = parse_memory(memory)
    own = None if policy.name == STREAM_POLICY else policy.name  # the default streaming policy's file is the model's
    consult = isinstance(share, float) and plan_file is not False  # a plan applies to a share only
    planned = None if kind or not consult else plans.kind_for(model, share, policy.name, own, plan_file)
    windows = tuple(sliding_windows(config) or ())
    shape = SlotShape(d, d, model.dtype.itemsize, stat_bytes(policy.stats), layers_heads, group, head_id, windows)
    spend = Spending(floor, policy.needs_prompt, kind or planned, head_from(policy), planned is not None)
    return plan_memory(memory, shape, spend)
