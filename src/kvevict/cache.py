"""A transformers ``Cache`` whose layers hold at most ``budget`` tokens per (sequence, KV head), or
with adaptive policies (Ada-KV) ``kv_heads x budget`` per (sequence, layer), shared by the heads.

Storage grows in pages as a sequence does, never past the budget (``storage.PAGE``); each layer is
an ``EvictingLayer`` (``kvevict.layer``). Rows of one batch may each have their own policy and
budget (``kvevict.rows``, continuous batching). ``make_cache`` builds one from a model and a policy,
a token budget or a memory budget.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers.cache_utils import Cache

from . import capture
from .attention import ATTN_NAME, register
from .budget import check_budget, layer_budgets, resolve_budget
from .default_policy import pick_policy
from .input_checks import max_positions, no_new_tokens, positions_after
from .layer import EvictingLayer
from .memory import MemoryPlan, plan_for_model, storage_kind
from .policies import Policy, make_policy
from .rope import rope_inv_freq
from .shape import check_hookable, head_dim_of, layer_windows
from .spec import CacheRequest
from .stock import STOCK_BYTES
from .storage import DEFAULT_GROUP, Storage, check_group


class EvictingCache(Cache):
    """A list of ``EvictingLayer``, one per decoder layer, passed to ``generate`` as ``cache``."""

    max_positions: int | None = None  # make_cache sets the model's, unless compact; None once warned

    def __init__(
        self,
        policy: Policy,
        budget,
        num_layers: int,
        inv_freq=None,
        storage: Storage | None = None,
        windows: list | None = None,
        pools=None,
        slack: int | None = None,
    ):
        windows = windows or [None] * num_layers
        budgets = layer_budgets(policy, budget, num_layers, windows)
        self.storage = storage or Storage()
        super().__init__(
            layers=[
                EvictingLayer(policy, b, i, inv_freq, self.storage, w, pools, slack)
                for i, (b, w) in enumerate(zip(budgets, windows))
            ]
        )
        if isinstance(budget, MemoryPlan):  # a schedule's tokens (kvzip-pool's) still spend the plan's
            for layer in self.layers:  # bytes: its recent tiers are paid in slots, as a share's are
                layer.spec.memory_plan = True
        self.policy = policy

    def compileable(self, on: bool = True) -> "EvictingCache":
        """Declare the decode step compileable (``torch.compile(fullgraph=True)`` traces it, see
        docs/guide.md), so transformers' ``generate`` compiles it through its ``compile_config``, and on
        CUDA by itself (CUDA graphs). Off by default: a compiled step is not yet measured on a GPU,
        and a compileable cache holds each tier's budget of slots from the prompt on
        (``kvevict.capture``). Returns the cache."""
        for layer in self.layers:
            layer.is_compileable = on
            layer.wide_positions = on and capture.wide_positions(self.max_positions)
            if on:
                capture.prepare(layer)
        return self

    def set_prompt_length(self, n: int) -> None:
        """Fix fractional budgets against the whole prompt before it is fed in chunks
        (``kvevict.prefill`` does it; call it before ``generate(..., prefill_chunk_size=s)``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"the prompt length must be a positive int number of tokens, got {n!r}.")
        for layer in self.layers:
            if not layer.is_initialized:
                if isinstance(layer.budget_spec, MemoryPlan):  # a short prompt is kept at 16 bits
                    layer.storage = layer.budget_spec.storage_for(n, layer.storage)
                layer.budget_spec = resolve_budget(layer.budget_spec, n)
                layer.prompt_len = n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # A float budget not fixed by set_prompt_length is taken of the first forward. A second
        # multi-token forward before any one-token (decoding) step means the prompt came in chunks
        # (generate's prefill_chunk_size): the budget was a fraction of its first chunk only.
        first = self.layers[0]
        if layer_idx == 0 and self.max_positions is not None and not torch.compiler.is_compiling():
            self.max_positions = positions_after(first, key_states.shape[2], self.max_positions)
        if layer_idx == 0 and isinstance(first.budget_spec, float):
            if not first.is_initialized:
                self._decoding = False
            elif key_states.shape[2] == 1:
                self._decoding = True
            elif not self._decoding:
                raise ValueError(
                    "a float budget is a fraction of the prompt, but the prompt is coming in chunks "
                    f"(generate's prefill_chunk_size, or several model calls), so it was taken of the first "
                    f"{first.seen}-token chunk. Call cache.set_prompt_length(input_ids.shape[1]) on a new cache "
                    "before generate (kvevict.prefill does it), or pass an int budget."
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if query_length == 0:  # the first thing a forward asks: fail here, not reshaping 0 elements later
            raise ValueError(no_new_tokens(self.get_seq_length()))
        return super().get_mask_sizes(query_length, layer_idx)

    def can_append(self, other: "EvictingCache") -> bool:
        """Whether ``append_rows(other)`` can merge the two: both filled, same storage and model;
        any budgets, and any policies that can share a forward (``rows.shareable``)."""
        return len(self.layers) == len(other.layers) and all(a.can_append(b) for a, b in zip(self.layers, other.layers))

    def append_rows(self, other: "EvictingCache") -> None:
        """Append ``other``'s sequences to this cache's batch (continuous batching); ``other`` is used up."""
        for a, b in zip(self.layers, other.layers):
            a.append_rows(b)

    def kv_bytes(self) -> int:
        """Every byte the cache holds now: keys and values (packed codes with their steps and zeros
        when quantized), positions, validity and policy statistics, of every layer and tier."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def full_kv_bytes(self, dtype_bytes: int | None = STOCK_BYTES) -> int:
        """Bytes a stock transformers cache would hold for the tokens seen so far (``kvevict.stock``):
        every token of a full-attention layer, the last window - 1 of a sliding one, at
        ``dtype_bytes`` per value: 2 (16 bits, the denominator of every ratio), or None for the
        model's own dtype."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                h, dk, dv = layer.dims
                b = layer.n_real.shape[0]
                # a sliding layer of the stock cache keeps its last window - 1 tokens
                kept = layer.seen if layer.window is None else min(layer.seen, layer.window - 1)
                total += b * h * kept * (dk + dv) * (dtype_bytes or layer.dtype.itemsize)
        return total

    def peak_entries(self) -> int:
        """Most entries any layer held at once, per (sequence, KV head): budget + largest chunk."""
        return max(layer.peak_entries for layer in self.layers)

    @property
    def budget(self) -> int | None:
        return self.layers[0].budget


def make_cache(
    model,
    policy=None,
    budget=None,
    recent=None,
    compact=False,
    kv_bits=None,
    group=None,
    evicted_bits=None,
    evicted_budget=None,
    memory=None,
    question=None,
    plan=None,
    pages=None,
    keys=None,
    slack=None,
    **policy_params,
) -> EvictingCache:
    """A cache for ``model.generate(..., cache=cache)`` that evicts to ``budget`` tokens per layer and KV head.

    budget: int (tokens kept per layer and KV head) or float in (0, 1] (that fraction of the prompt length); default
    0.2. recent: the recent window (default: the policy's; half the budget for H2O).
    compact: give the kept tokens consecutive positions (keys re-rotated, as StreamingLLM does), so the model never
    sees a distance longer than the cache and can go on past its context length.
    kv_bits: store kept keys and values in 16 (float16), 8, 4 or 2 bits (packed, per-token groups of ``group``
    channels, default 32 or gcd(32, head_dim); see kvevict.storage.codes); None keeps the model's dtype.
    keys: the basis keys are stored in: None (default) rotated for packed (8, 4, 2-bit) tiers, "rotated" or "raw"
    (``kvevict.storage.Storage``, ``kvevict.keyspace``).
    evicted_bits: demote evicted tokens into a tier of that many bits instead of dropping them (MiKV);
    ``evicted_budget`` caps it (int tokens or fraction of the prompt; default the rest of the prompt).
    policy: a name (``kvevict.POLICIES``), a Policy, or a cache spec naming its storage and budget too
    (``kvevict.spec``: ``h2o/int4@0.2``, ``kvzip-pool@memory=0.1``); not given: ``h2o`` with a token budget, ``mas``
    with a memory budget (the streaming policy a cache handed to ``model.generate`` needs,
    ``kvevict.default_policy.pick_policy``; a prompt known in advance is better served by ``kvevict.generate.generate``,
    which picks ``kvzip-probe`` for a model with a probe, else ``kvzip-sample`` from 20%, else ``kvzip-pool``).
    memory: a budget in bytes instead: a fraction of what a stock cache would hold for the same tokens in 16 bits
    (0.2, '20%'; ``kvevict.stock``) or bytes per sequence ('64MiB'). It replaces ``budget`` with the split of tokens
    kept x bits per token measured best (``kvevict.memory.plan_memory``): the recommended way to bound a cache.
    Storage options given with it say how to spend the bytes instead of the rule: ``kv_bits`` 16, 8 or 4 (evict
    until the kept tokens fit at those bits), or ``kv_bits=8, evicted_bits=4`` (the policy's top at int8, the next
    at int4). A fraction keeps at least ``kvevict.memory.MIN_TOKENS`` tokens per layer and KV head, so a short
    prompt is never cut.
    plan: with a fractional ``memory``, the plan file ``kvevict calibrate`` wrote for this model (a path); None
    (default) uses the model's calibrated plan when one is in kvevict's cache, else the built-in rule; False always
    the built-in rule.
    question: the prompt's last N tokens are its question: never evicted, and the observation window of the policies
    that have one (SnapKV, expected attention). Honest only when the whole question is in the prompt at prefill
    (kvevict.generate.question_tokens counts it).
    pages: a ``kvevict.storage.Pools``: every row holds only its own pages of pools shared by the caches made with
    it, so caches appended to one another (continuous batching) keep each row's own size and move no bytes; None
    (default): each layer's storage is one rectangle as wide as its widest row.
    adaptive=True (a policy parameter; or the name ``ada-<policy>``, ``adakv`` = Ada-SnapKV): Ada-KV head-adaptive
    budgets, the layer's kv_heads x budget slots shared by its heads (see policies/adakv.py).
    slack: evict in batches. With slack s a full layer ranks once every s decode steps and evicts its s lowest
    tokens at once; the next s - 1 tokens take the freed slots unranked (1: every step ranks and evicts one token).
    The budget stays the most a layer holds (its slots, every one counted by ``kv_bytes``): it keeps between
    budget - s + 1 and budget tokens. None (default): ``kvevict.budget.default_slack``, a sixteenth of the layer's
    budget, at most 16 (1 below 32 tokens, and in sliding-window layers, whose window moves a token a step).
    Spec: ``h2o@0.2+slack=16``.
    Switches the model's attention to the ``kvevict`` implementation (exact with any other cache); the arguments
    become one ``kvevict.spec.CacheRequest``, which ``cache_for`` builds from.
    """
    request = CacheRequest(
        policy,
        budget,
        recent,
        compact,
        kv_bits,
        group,
        evicted_bits,
        evicted_budget,
        memory,
        question,
        plan,
        pages,
        keys,
        slack,
        policy_params,
    )
    return cache_for(model, request.checked())


def cache_for(model, request: CacheRequest) -> EvictingCache:
    """``make_cache``'s cache for a checked ``request`` (``CacheRequest.checked``)."""
    pol = _policy(request)
    head_dim = head_dim_of(model)
    group = request.group
    if group is None:  # 32 channels per zero/step, or what divides a smaller head
        group = math.gcd(DEFAULT_GROUP, head_dim) if head_dim else DEFAULT_GROUP
    budget, storage = _budget_and_storage(model, request, pol, group)
    num_layers = check_hookable(model)
    if head_dim is not None:  # fail now, not inside the first forward
        for bits in (storage.kv_bits, storage.evicted_bits):
            check_group(storage.group, head_dim, bits)
    if isinstance(budget, int):
        _check_layer_budgets(pol, budget, num_layers)
    register()
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise ValueError(f"{type(model).__name__} refused attn_implementation={ATTN_NAME!r}; kvevict cannot hook it.")
    inv_freq = rope_inv_freq(model) if request.compact else None
    windows = layer_windows(model)
    cache = EvictingCache(pol, budget, num_layers, inv_freq, storage, windows, request.pages, request.slack)
    if not request.compact:  # compact positions never pass the cache size
        cache.max_positions = max_positions(model)
    return cache


def _policy(request: CacheRequest) -> Policy:
    """The request's policy: the one named or given, or the streaming one a memory budget picks;
    ``question`` and compact positions checked against it."""
    policy = request.policy
    if policy is None:
        policy = pick_policy(prompt_known=False, memory=request.memory is not None)
    pol = make_policy(policy, **request.params)
    question = request.question
    if question is not None:
        if isinstance(question, bool) or not isinstance(question, int) or question < 0:
            raise ValueError(f"question must be an int number of prompt tokens >= 0, got {question!r}.")
        pol = dataclasses.replace(pol, question=question)
    if request.compact and pol.adaptive:
        raise ValueError(
            "adaptive budgets cannot be combined with compact positions (each head's kept "
            "tokens would need their own ranks); use one or the other."
        )
    return pol


def _budget_and_storage(model, request: CacheRequest, pol: Policy, group: int) -> tuple:
    """(budget, Storage): as given, or a memory budget's plan (``kvevict.memory.plan_for_model``),
    its storage fixed now for a policy recorded on its prompt (kvzip)."""
    budget = DEFAULT_BUDGET if request.budget is None and request.memory is None else request.budget
    kv_bits, evicted_bits, evicted_budget = request.kv_bits, request.evicted_bits, request.evicted_budget
    if request.memory is not None:
        kind = storage_kind(kv_bits, evicted_bits, evicted_budget)
        p = plan_for_model(model, request.memory, pol, group, plan_file=request.plan, kind=kind)
        storage, known = p.storage, pol.prompt_tokens
        if known and isinstance(p.budget, MemoryPlan):  # a recorded prompt (kvzip): its storage now
            storage = p.budget.storage_for(known, storage)
        budget, kv_bits, evicted_bits, evicted_budget = (
            p.budget,
            storage.kv_bits,
            storage.evicted_bits,
            storage.evicted_budget,
        )
    check_budget(budget)
    storage = Storage(
        kv_bits=kv_bits, group=group, evicted_bits=evicted_bits, evicted_budget=evicted_budget, keys=request.keys
    )
    return budget, storage


def _check_layer_budgets(pol: Policy, budget: int, num_layers: int) -> None:
    """The policy's parameters against every layer's budget in tokens (PyramidKV's differ)."""
    per_layer = layer_budgets(pol, budget, num_layers)
    for b in sorted(set(per_layer)):
        try:
            pol.check(b)
        except ValueError as err:
            if len(set(per_layer)) == 1:
                raise
            raise ValueError(
                f"{err} ({pol.name} gives the layers budgets from {min(per_layer)} to {max(per_layer)} tokens.)"
            ) from None


DEFAULT_BUDGET = 0.2  # a fifth of the prompt's tokens
