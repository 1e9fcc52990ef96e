"""A transformers ``Cache`` whose layers hold at most ``budget`` tokens per (sequence, KV head).

Storage is preallocated at the budget and written by index: a token that arrives while the cache
is full takes the slot of the token its policy evicts (no concatenation, no copy of the cache per
step). Each (sequence, KV head) keeps its own set of tokens, in arbitrary slot order; each slot
remembers the token's position, so the keys stay rotated at their original positions.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import ATTN_NAME, PaddingInfo, _Segments, hand_off, register
from .policies import Candidates, Policy, make_policy
from .rope import compact_positions, rope_inv_freq, shift_keys


def resolve_budget(budget, prompt_len: int) -> int:
    """An int budget is tokens; a float in (0, 1] is that fraction of the prompt length."""
    if isinstance(budget, float):
        return max(1, math.ceil(budget * prompt_len - 1e-9))
    return budget


def check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget must be an int (tokens) or a float in (0, 1] (fraction of the prompt), got {budget!r}.")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(
            f"a float budget is a fraction of the prompt length and must be in (0, 1], got {budget}; "
            "pass an int for a number of tokens."
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}.")


class EvictingLayer(CacheLayerMixin):
    """One decoder layer's budgeted key/value storage plus the per-slot state its policy needs."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, policy: Policy, budget, layer_idx: int, inv_freq=None):
        super().__init__()
        self.policy = policy
        self.inv_freq = inv_freq  # set: compact positions (keys re-rotated to their rank each step)
        self.budget_spec = budget
        self.layer_idx = layer_idx
        self.budget: int | None = None
        self.filled = 0  # slots written so far; equal for every (sequence, head)
        self.seen = 0  # tokens this layer has been given, padding included
        self.evicted = 0  # tokens evicted per (sequence, head)
        self.peak_entries = 0  # most key/value entries held at once (storage + incoming chunk)
        self.returned_keys = None
        self._new = None
        self._padded = False  # whether any slot may hold padding (then attention needs the mask)

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, m, d = key_states.shape
        self.budget = resolve_budget(self.budget_spec, m)
        self.policy.check(self.budget)
        self.dtype, self.device = key_states.dtype, key_states.device
        B = self.budget
        self.keys = torch.zeros(b, h, B, d, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(b, h, B, value_states.shape[-1], dtype=self.dtype, device=self.device)
        self.pos = torch.zeros(b, h, B, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(b, h, B, dtype=torch.bool, device=self.device)
        self.stats = {n: torch.zeros(b, h, B, dtype=torch.float32, device=self.device) for n in self.policy.stats}
        self.n_real = torch.zeros(b, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"this cache was filled with batch size {self.keys.shape[0]} and got {key_states.shape[0]}; "
                "make a new cache for a new batch."
            )
        self._new = (key_states, value_states)
        # entries this layer holds during this step: stored slots + the incoming tokens
        self.peak_entries = max(self.peak_entries, self.filled + key_states.shape[2])
        self.returned_keys = self.keys[:, :, : self.filled]
        hand_off(self)
        return self.returned_keys, self.values[:, :, : self.filled]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen  # positions go on from every token seen, kept or evicted

    def get_max_length(self) -> int:
        return -1  # any number of tokens can stream through

    def reset(self) -> None:
        self.__init__(self.policy, self.budget_spec, self.layer_idx, self.inv_freq)

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in ("keys", "values", "pos", "valid", "n_real"):
            setattr(self, name, fn(getattr(self, name)))
        self.stats = {n: fn(t) for n, t in self.stats.items()}

    def reorder_cache(self, beam_idx) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._map_batch(lambda t: t[indices])

    # -- what attention needs, and what it hands back -----------------------------------------
    def kv_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def segments(self, value_view, info: PaddingInfo | None, q_len: int) -> _Segments:
        k_new, v_new = self._new
        valid_new = None
        if info is not None and info.padding is not None:
            valid_new = info.real_upto(self.seen + q_len)[:, self.seen:]
            self._padded = True
        if valid_new is None:
            pos_new = self.n_real[:, None] + torch.arange(q_len, device=self.device)
        else:
            pos_new = self.n_real[:, None] + valid_new.long().cumsum(1) - 1
        f = self.filled
        k_past, pos_past = self.returned_keys, self.pos[:, :, :f]
        if self.inv_freq is not None and f:
            # compact: kept keys move to their rank, new tokens follow at f, f + 1, ...; the shift
            # d = (first new position) - f maps compact positions onto the queries' own rotation
            shift = (self.n_real - f).view(-1, 1, 1)
            pos_past = compact_positions(pos_past, self.valid[:, :, :f]) + shift
            k_past = shift_keys(k_past, pos_past - self.pos[:, :, :f], self.inv_freq)
        return _Segments(
            k_past=k_past, v_past=value_view, pos_past=pos_past,
            valid_past=self.valid[:, :, :f] if self._padded else None,
            k_new=k_new, v_new=v_new, pos_new=pos_new, valid_new=valid_new,
        )

    def absorb(self, stats: dict, valid_new, pos_new) -> None:
        """Store the new tokens, evicting to the budget, after attention has scored everything."""
        k_new, v_new = self._new
        self._new = None
        b, h, m, _ = k_new.shape
        B, f = self.budget, self.filled
        self.n_real += m if valid_new is None else valid_new.sum(1)
        for name, st in self.stats.items():
            if name == "last":
                st[..., :f] = stats[name][..., :f]
            elif name == "hits_ema":  # older hits fade: a history window of about 1 / (1 - gamma) steps
                st[..., :f].mul_(self.policy.decay() ** m).add_(stats[name][..., :f])
            else:
                st[..., :f] += stats[name][..., :f]
        new = {
            "keys": k_new, "values": v_new,
            "pos": pos_new.view(-1, 1, m).expand(b, h, m),
            "valid": (torch.ones(1, 1, m, dtype=torch.bool, device=self.device) if valid_new is None
                      else valid_new.view(b, 1, m)).expand(b, h, m),
        }
        new.update({n: stats[n][..., f:] for n in self.stats})
        if f + m <= B:
            for name, t in new.items():
                self._store(name)[:, :, f: f + m] = t
            self.filled = f + m
        elif m == 1:
            self._replace_one(new, valid_new is None)
        else:
            self._replace_many(new, m)
        self.evicted += max(0, f + m - B)
        self.seen += m

    def _store(self, name: str) -> torch.Tensor:
        return self.stats[name] if name in self.stats else getattr(self, name)

    def _candidates(self, new: dict | None) -> Candidates:
        """All B slots (empty ones invalid) followed by the new tokens; the slots alone if ``new`` is None."""
        names = ("pos", "valid", *self.stats)
        if new is None:
            cat = {name: self._store(name) for name in names}
        else:
            cat = {name: torch.cat([self._store(name), new[name]], dim=-1) for name in names}
        return Candidates(
            stats={n: cat[n] for n in self.stats}, pos=cat["pos"], valid=cat["valid"],
            newest=(self.n_real - 1).view(-1, 1, 1), budget=self.budget, layer_idx=self.layer_idx,
        )

    def _replace_one(self, new: dict, all_real: bool) -> None:
        """Decoding: the new token takes the slot of the lowest-priority candidate."""
        B = self.budget
        if all_real and self.policy.keeps_newest(B) and self.policy.independent:
            # the newcomer is protected and cannot change the others' ranks: rank the slots only
            slot, take = self.policy.priority(self._candidates(None)).argmin(-1, keepdim=True), None
        else:
            victim = self.policy.priority(self._candidates(new)).argmin(-1, keepdim=True)  # (b, h, 1)
            slot, take = victim.clamp(max=B - 1), victim < B
        for name, t in new.items():
            store = self._store(name)
            idx = slot if store.dim() == 3 else slot.unsqueeze(-1).expand(-1, -1, 1, store.shape[-1])
            src = t if take is None else torch.where(
                take if store.dim() == 3 else take.unsqueeze(-1), t, store.gather(2, idx))
            store.scatter_(2, idx, src)

    def _replace_many(self, new: dict, m: int) -> None:
        """Prefill chunks: evict the m lowest-priority of the B slots + m new tokens; the kept new
        tokens move into the evicted slots, pairwise, so storage is overwritten in place."""
        B = self.budget
        prio = self.policy.priority(self._candidates(new))
        out = prio.topk(m, dim=-1, largest=False).indices  # (b, h, m) evicted candidates
        ev_slot = torch.zeros(prio.shape[0], prio.shape[1], B + m, dtype=torch.bool, device=self.device)
        ev_slot.scatter_(-1, out, True)
        k = min(m, B)
        # evicted slots first, then kept ones (stable); kept new tokens first, then evicted ones
        targets = torch.argsort((~ev_slot[..., :B]).to(torch.int8), dim=-1, stable=True)[..., :k]
        sources = torch.argsort(ev_slot[..., B:].to(torch.int8), dim=-1, stable=True)[..., :k]
        n_moves = ev_slot[..., :B].sum(-1, keepdim=True)  # = number of kept new tokens
        move = torch.arange(k, device=self.device).view(1, 1, k) < n_moves  # (b, h, k)
        for name, t in new.items():
            store = self._store(name)
            if store.dim() == 3:
                ti, si, mv = targets, sources, move
            else:
                d = store.shape[-1]
                ti, si = targets.unsqueeze(-1).expand(-1, -1, -1, d), sources.unsqueeze(-1).expand(-1, -1, -1, d)
                mv = move.unsqueeze(-1)
            store.scatter_(2, ti, torch.where(mv, t.gather(2, si), store.gather(2, ti)))
        self.filled = B


class EvictingCache(Cache):
    """A list of ``EvictingLayer``, one per decoder layer, passed to ``generate`` as ``past_key_values``."""

    def __init__(self, policy: Policy, budget, num_layers: int, inv_freq=None):
        budgets = layer_budgets(policy, budget, num_layers)
        super().__init__(layers=[EvictingLayer(policy, b, i, inv_freq) for i, b in enumerate(budgets)])
        self.policy = policy

    def set_prompt_length(self, n: int) -> None:
        """Fix fractional budgets against the whole prompt before it is fed in chunks
        (``kvevict.prefill`` does it; call it before ``generate(..., prefill_chunk_size=s)``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"the prompt length must be a positive int number of tokens, got {n!r}.")
        for layer in self.layers:
            if not layer.is_initialized:
                layer.budget_spec = resolve_budget(layer.budget_spec, n)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # A float budget not fixed by set_prompt_length is taken of the first forward. A second
        # multi-token forward before any one-token (decoding) step means the prompt came in chunks
        # (generate's prefill_chunk_size): the budget was a fraction of its first chunk only.
        first = self.layers[0]
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

    def kv_bytes(self) -> int:
        """Bytes held by the key/value storage of every layer now."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes a full (unevicted) cache would hold for the tokens seen so far."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, d = layer.keys.shape
                total += b * h * layer.seen * (d + layer.values.shape[-1]) * layer.keys.element_size()
        return total

    def peak_entries(self) -> int:
        """Most entries any layer held at once, per (sequence, KV head): budget + largest chunk."""
        return max(layer.peak_entries for layer in self.layers)

    @property
    def budget(self) -> int | None:
        return self.layers[0].budget


def layer_budgets(policy: Policy, budget, num_layers: int) -> list:
    """One budget per layer: uniform, or the policy's own schedule (PyramidKV). A fractional budget
    stays fractional, scaled per layer, and is resolved against the prompt length."""
    schedule = getattr(policy, "layer_budgets", None)
    if schedule is None:
        return [budget] * num_layers
    if isinstance(budget, float):
        nominal = 1 << 20
        return [budget * b / nominal for b in schedule(nominal, num_layers)]
    return schedule(budget, num_layers)


def _check_hookable(model) -> int:
    """Raise a clear error unless the model routes attention through AttentionInterface."""
    name = type(model).__name__
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; kvevict evicts the self-attention cache of decoder-only models.")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not getattr(model, "_supports_attention_backend", False) or can_set is None or not can_set():
        raise ValueError(
            f"{name} does not route its attention through transformers' AttentionInterface, so kvevict "
            "cannot hook it. Use a decoder whose modeling code supports attn_implementation switching "
            "(Llama, Qwen2, Mistral, Gemma, Phi3, ...)."
        )
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise ValueError(f"{name} has {odd} layers (not softmax attention); kvevict cannot budget their state.")
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"cannot find the number of decoder layers of {name} (config.num_hidden_layers).")
    return n


def make_cache(model, policy="h2o", budget=0.2, recent=None, compact=False, **policy_params) -> EvictingCache:
    """A cache for ``model.generate(..., past_key_values=cache)`` that keeps at most ``budget``
    tokens per layer and KV head, evicting with ``policy``.

    budget: int (tokens kept per layer and KV head) or float in (0, 1] (that fraction of the
    prompt length). recent: the recent window (default: the policy's; half the budget for H2O).
    compact: give the kept tokens consecutive positions (keys re-rotated, as StreamingLLM does), so
    the model never sees a distance longer than the cache and can go on past its context length.
    Switches the model's attention to the ``kvevict`` implementation (exact with any other cache).
    """
    check_budget(budget)
    if recent is not None:
        if isinstance(recent, bool) or not isinstance(recent, int):
            raise ValueError(f"recent must be an int number of tokens, got {recent!r}.")
        policy_params["recent"] = recent
    pol = make_policy(policy, **policy_params)
    num_layers = _check_hookable(model)
    if isinstance(budget, int):
        per_layer = layer_budgets(pol, budget, num_layers)
        for b in sorted(set(per_layer)):
            try:
                pol.check(b)
            except ValueError as err:
                if len(set(per_layer)) == 1:
                    raise
                raise ValueError(f"{err} ({pol.name} gives the layers budgets from {min(per_layer)} "
                                 f"to {max(per_layer)} tokens.)") from None
    register()
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise ValueError(f"{type(model).__name__} refused attn_implementation={ATTN_NAME!r}; kvevict cannot hook it.")
    return EvictingCache(pol, budget, num_layers, rope_inv_freq(model) if compact else None)
