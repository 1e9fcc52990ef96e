"""One decoder layer's budgeted keys and values (``EvictingLayer``): its tiers of slots, the new
tokens it hands attention (``segments``), and what it keeps of them afterwards (``absorb``).

A token that arrives while the layer is full takes the slot of the token its policy evicts (no
concatenation, no copy per step). Each (sequence, KV head) keeps its own set of tokens in arbitrary
slot order; each slot remembers the token's position, so keys stay rotated at their original
positions. The features a layer may carry are objects beside it: a sliding window
(``policies.window``), a low-bit tier for evicted tokens (a second ``Tier``), shared Ada-KV budgets
(``headpool.HeadPool``: one row per sequence, its heads' slots pooled), the evicted tokens' mean slot (``merge.Summary``),
keys in a rotated basis (``keyspace.KeySpace``), compact positions (``rope``), pages
(``storage.Pools``) and per-row policies (``rows.Rows``).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import PaddingInfo, _Segments, hand_off
from .budget import default_slack, resolve_budget
from .headpool import HeadPool, cat_slots
from .keyspace import KeySpace
from .merge import Summary
from .policies import Policy
from .policies.window import Windowed, window_recency
from .rope import CompactPositions
from .rows import Rows, shareable
from .stats import stat_bytes
from .storage import Storage, check_group
from .storage.rect import DenseStore
from .tier import POS16_MAX, Tier

RECENT_SHARE = 16  # a recent tier (Tier.recent) costs at most 1 / 16 of the bytes of the tokens kept


class EvictingLayer(CacheLayerMixin):
    """One decoder layer's budgeted key/value storage: one ``Tier`` of ``budget`` slots, or two for
    mixed precision (the evicted tokens demoted to ``evicted_bits`` instead of dropped)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: Policy,
        budget,
        layer_idx: int,
        inv_freq=None,
        storage: "Storage | None" = None,
        window: int | None = None,
        pools=None,
        slack: int | None = None,
    ):
        super().__init__()
        # batch eviction: one ranking frees ``slack`` slots for the next ``slack`` steps
        # (``Tier._turn_over``); None: ``budget.default_slack`` of the layer's budget
        self.slack = slack
        self.pools = pools  # a kvevict.storage.Pools: each row its own pages of a shared pool (None: rectangles)
        self.policy = policy
        self.window = window  # a sliding-window layer's ``sliding_window`` (None: global attention)
        # compact positions (keys re-rotated to their rank each step), or None
        self.compact = None if inv_freq is None else CompactPositions(inv_freq)
        self.budget_spec = budget
        self.memory_plan = hasattr(budget, "storage_for")  # a memory plan's share (set_prompt_length resolves it)
        self.recent_cost = 0
        self.layer_idx = layer_idx
        self.storage = storage or Storage()
        self.budget: int | None = None
        self.prompt_len: int | None = None  # when known before the first forward (chunked prefill)
        self.tiers: list[Tier] = []
        self.seen = 0  # tokens this layer has been given, padding included
        # the most real tokens any row holds, on the host: exact when read (``_fit_positions``), above
        # it by the padding fed since; what decides the positions' width, never ``seen``
        self.longest = 0
        self.evicted = 0  # tokens that left the first tier, per (sequence, head)
        self.peak_entries = 0  # most key/value entries held at once (storage + incoming chunk)
        self.returned_keys = None
        self.prompt_end: torch.Tensor | None = None
        self.summary: Summary | None = None  # the evicted tokens' mean slot (policy.merge)
        self.keyspace: KeySpace | None = None  # keys stored centred and rotated (low-bit storage)
        self.pool: HeadPool | None = None  # Ada-KV: the heads share one row of slots
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # update()'s keys and values, until absorbed
        self._padded = False  # whether any slot may hold padding (then attention needs the mask)
        self.position_check = None  # the last decode step's positions check, read by the next forward
        self._group: int | None = None  # query heads per KV head, once a forward has shown its queries

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, m, dk = key_states.shape
        if hasattr(self.budget_spec, "storage_for"):  # a memory plan: a short prompt is kept at 16 bits
            self.storage = self.budget_spec.storage_for(self.prompt_len or m, self.storage)
        self.budget, policy = self._windowed(resolve_budget(self.budget_spec, m))
        policy.check(self.budget)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.dims = (h, dk, value_states.shape[-1])
        st = self.storage
        check_group(st.group, dk, st.kv_bits)
        check_group(st.group, value_states.shape[-1], st.kv_bits)
        # adaptive (Ada-KV): one row of h x budget slots per sequence, shared by the h heads
        self.pool = HeadPool(h, self.device) if policy.adaptive and h > 1 else None
        self.shared = 1 if self.pool is None else h
        self.prompt_end = None  # (b, 1, 1) real prompt tokens per row, where the question ends
        # a share of a short prompt may leave fewer slots than the slack asked; a sliding layer's
        # window moves a token a step, and what leaves it must leave at once (as the stock cache's)
        slack = default_slack(self.budget) if self.slack is None else min(self.slack, self.budget)
        slack = 1 if self.window is not None else slack
        # a recent tier where its bytes are at most a sixteenth of the kept tokens' (RECENT_SHARE);
        # a memory plan holds it too, in as many fewer slots as it takes
        recent = self.compact is None and slack > 1 and st.kv_bits in (8, 4, 2)
        cost = self._recent_slots(slack, dk, value_states.shape[-1], policy) if recent else 0
        recent = recent and cost * RECENT_SHARE <= self.budget
        self.recent_cost = cost if recent and self.memory_plan else 0  # the slots a memory plan gave up
        if self.recent_cost:
            self.budget -= self.recent_cost
            policy.check(self.budget)
        args = (b, h // self.shared, dk, value_states.shape[-1], self.dtype, self.device, policy.stats)
        self.tiers = [
            Tier(
                self.budget * self.shared,
                *args,
                bits=st.kv_bits,
                group=st.group,
                heads=self.shared,
                pools=self.pools,
                slack=slack,
                recent=recent,
            )
        ]
        if self.recent_cost:  # a memory plan spends its bytes from the start, as planned
            self.tiers[0].make_recent()
        if st.evicted_bits is not None:
            check_group(st.group, dk, st.evicted_bits)
            check_group(st.group, value_states.shape[-1], st.evicted_bits)
            if st.evicted_budget is not None:
                low = resolve_budget(st.evicted_budget, self.prompt_len or m)
            else:  # room for the rest of the prompt; later tokens evict by the policy
                low = max(1, (self.prompt_len or m) - self.budget)
            if self.window is not None:  # both tiers together never hold more than the window
                low = min(low, self.window - 1 - self.budget)
            if low > 0:
                self.tiers.append(
                    Tier(
                        low * self.shared,
                        *args,
                        bits=st.evicted_bits,
                        group=st.group,
                        heads=self.shared,
                        pools=self.pools,
                    )
                )
        self.n_real = torch.zeros(b, dtype=torch.long, device=self.device)
        self.rows = Rows(policy, self.budget, b, self.device)  # every row: this policy and budget
        self.summary = self._summary(b, h, dk, value_states.shape[-1])
        self.keyspace = KeySpace() if st.rotates_keys else None
        self._expose()
        self.is_initialized = True

    def _recent_slots(self, slack: int, dk: int, dv: int, policy) -> int:
        """The packed slots a recent tier's bytes take (``Tier.recent``: slack - 1 tokens a head in
        the model's dtype), which a memory budget gives up so that it holds them too."""
        stats = stat_bytes(policy.stats) + (1 if self.shared > 1 else 0)  # a pooled slot's head id
        dense = Storage(kv_bits=16).slot_bytes(dk, dv, 2, stats)  # 16 bits: Tier.recent
        packed = self.storage.slot_bytes(dk, dv, self.dtype.itemsize, stats)
        return math.ceil((slack - 1) * dense / packed)

    def _summary(self, b, h, dk, dv) -> "Summary | None":
        """The evicted tokens' mean slot (``kvevict.merge``) when the policy asks for it (``merge``).
        A sliding layer forgets by design (what leaves its window must not be attended) and compact
        positions re-rotate keys each step, which a sum of rotated keys cannot follow."""
        if not getattr(self.policy, "merge", False):
            return None
        if self.compact is not None:
            raise ValueError(
                "merge keeps evicted keys rotated at their own positions; it does not work with "
                "compact positions: drop compact=True or merge."
            )
        return None if self.window is not None else Summary(b, h, dk, dv, self.device)

    def _windowed(self, budget: int):
        """This layer's budget and policy: a sliding layer keeps at most the W - 1 tokens the stock
        cache keeps, by recency when the budget covers them (exact), else by its policy inside the
        window (see policies/window.py)."""
        if self.window is None:
            return budget, self.policy
        keep = self.window - 1
        if budget >= keep:
            return keep, window_recency(keep)
        return budget, Windowed(self.policy, self.window)

    def _expose(self) -> None:
        """``keys`` / ``values``: the first tier's storage (floats, or packed uint8 codes when quantized)."""
        self.keys, self.values = self.tiers[0].store.keys, self.tiers[0].store.values

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b = self.n_real.shape[0]
        if key_states.shape[0] != b:
            raise ValueError(
                f"this cache was filled with batch size {b} and got {key_states.shape[0]}; "
                "make a new cache for a new batch."
            )
        self._new = (key_states, value_states)
        held = sum(t.filled for t in self._parts()) // self.shared  # per (sequence, KV head), on average
        # entries this layer holds during this step: stored slots + the incoming tokens
        self.peak_entries = max(self.peak_entries, held + key_states.shape[2])
        t0 = self.tiers[0]
        if (
            len(self.tiers) == 1
            and self.shared == 1
            and isinstance(t0.store, DenseStore)
            and t0.store.keys.dtype == self.dtype
        ):
            self.returned_keys = t0.store.keys[:, :, : t0.filled]
            values = t0.store.values[:, :, : t0.filled]
        else:  # packed, two tiers or shared: attention reads the tiers itself; hand back shape-only stand-ins
            h, dk, dv = self.dims
            self.returned_keys = key_states.new_zeros(()).expand(b, h, held, dk)
            values = value_states.new_zeros(()).expand(b, h, held, dv)
        hand_off(self)
        return self.returned_keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen  # positions go on from every token seen, kept or evicted

    def get_max_length(self) -> int:
        return -1  # any number of tokens can stream through

    def reset(self) -> None:
        prompt_len, memory_plan = self.prompt_len, self.memory_plan
        type(self).__init__(
            self,
            self.policy,
            self.budget_spec,
            self.layer_idx,
            None if self.compact is None else self.compact.inv_freq,
            self.storage,
            self.window,
            self.pools,
            self.slack,
        )
        self.prompt_len, self.memory_plan = prompt_len, memory_plan

    def _parts(self) -> list:
        """The tiers as attention reads them: each, then its recent tier's waiting tokens."""
        return [p for t in self.tiers for p in t.parts()]

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for tier in self.tiers:
            tier.settle()
        if any(t.holes for t in self.tiers):
            # slots a turn-over freed stay empty below the rows' fills, no longer handed out in
            # order: from now on the layer masks and checks its slots as a padded batch does
            self._padded = True
        for tier in self.tiers:
            tier.map_batch(fn)
            tier.fit()  # rows with the widest budget may have left: storage narrows to the rest's
        self.n_real = fn(self.n_real)
        if self.prompt_end is not None:
            self.prompt_end = fn(self.prompt_end)
        self.rows.map_batch(fn)
        if self.summary is not None:
            self.summary.map_batch(fn)
        if self.keyspace is not None:
            self.keyspace.map_batch(fn)
        wanted = set(self.rows.stats)
        for tier in self.tiers:  # statistics only the rows that left read: dropped with them
            tier.keep_stats(wanted)
        self.budget = self.tiers[0].budget // self.shared
        if any(t.pos_dtype != torch.int16 for t in self.tiers):
            # the rows past 32,767 may have left: back to int16 once every row's positions fit (one
            # host read per batch change of a widened batch), so no row pays for one that left
            self.longest = int(self.n_real.max()) if self.n_real.numel() else 0
            for tier in self.tiers:
                tier.narrow_positions(self.longest - 1)
        self._expose()

    def reorder_cache(self, beam_idx) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._map_batch(lambda t: t[indices])

    def can_append(self, other: "EvictingLayer") -> bool:
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
            and shareable(self.rows.policies + other.rows.policies)
        )

    def append_rows(self, other: "EvictingLayer") -> None:
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
                if layer.prompt_end is None:
                    layer.prompt_end = torch.zeros(layer.n_real.shape[0], 1, 1, dtype=torch.long, device=self.device)
        self.rows.adopt(other.rows)
        theirs: list[torch.Tensor] = []

        def collect(t):
            theirs.append(t)
            return t

        for tier in other.tiers:  # every per-row tensor, in _map_batch's order
            tier.map_batch(collect)
        ends: list[torch.Tensor] = [] if other.prompt_end is None else [other.prompt_end]
        mean = [] if other.summary is None else other.summary.tensors()
        basis = [] if other.keyspace is None else other.keyspace.tensors()
        rows = iter([*theirs, other.n_real, *ends, other.rows.kind, *mean, *basis])
        self.longest = max(self.longest, other.longest)
        self._map_batch(lambda t: torch.cat([t, next(rows)]))
        for tier in other.tiers:  # paged: their rows' pages are this cache's now (a rectangle: copied)
            tier.disown()
        # rows of different fills: slots below ``filled`` that a row has not used are empty, masked
        self._padded = self._padded or any(len(set(t.fills)) > 1 for t in self.tiers)
        self._padded = self._padded or other._padded or any(t.caps is not None for t in self.tiers)
        self.seen = max(self.seen, other.seen)
        self.evicted = max(self.evicted, other.evicted)
        self.peak_entries = max(self.peak_entries, other.peak_entries)

    # -- the first tier's state, as the layer's own (what was kept, where) -------------------
    @property
    def pos(self) -> torch.Tensor:
        return self.tiers[0].pos

    @property
    def valid(self) -> torch.Tensor:
        return self.tiers[0].valid

    @property
    def stats(self) -> dict:
        return self.tiers[0].stats

    @property
    def filled(self) -> int:
        return self.tiers[0].filled

    # -- what attention needs, and what it hands back -----------------------------------------
    def attention_request(self) -> tuple[tuple, dict]:
        """The statistics attention must collect for this layer (every one its tiers carry: the
        union of its rows' policies') and the parameters they need."""
        return self.tiers[0].stat_names, self.rows.attention_params()

    def kv_bytes(self) -> int:
        """Every byte this layer holds: keys and values (codes, steps and zeros when packed),
        positions, validity, head ids (adaptive) and the policy's statistics of every tier."""
        if not self.is_initialized:
            return 0
        extra = self.prompt_end.nbytes if self.prompt_end is not None else 0
        if self.summary is not None:
            extra += self.summary.nbytes()
        if self.keyspace is not None:
            extra += self.keyspace.nbytes()
        return sum(t.nbytes() for t in self.tiers) + self.n_real.nbytes + extra

    def segments(self, value_view, info: PaddingInfo | None, q_len: int, query=None) -> _Segments:
        """What attention reads this forward: the stored slots and the new tokens. ``query``: with
        keys stored rotated, the queries are rotated with the new keys (``seg.query``)."""
        assert self._new is not None, "update() hands the new keys over before attention reads the segments"
        k_new, v_new = self._new
        if query is not None:
            self._group = query.shape[1] // k_new.shape[1]
        valid_new = None
        if info is not None and info.padding is not None:
            valid_new = info.real_upto(self.seen + q_len)[:, self.seen :]
            self._padded = True
        knorm_new = None
        if self.keyspace is not None:  # stored and attended in the rotated basis (kvevict.keyspace)
            if "knorm" in self.tiers[0].stat_names:  # a key's norm, as the model made it
                knorm_new = k_new.float().norm(dim=-1)
            if query is None:
                k_new = self.keyspace.enter(k_new, valid_new)
            else:
                k_new, query = self.keyspace.enter_with_query(k_new, query, valid_new)
            self._new = (k_new, v_new)
        if valid_new is None:
            pos_new = self.n_real[:, None] + torch.arange(q_len, device=self.device)
        else:
            pos_new = self.n_real[:, None] + valid_new.long().cumsum(1) - 1
        if q_len > 1:  # a prompt or a chunk: the tokens waiting in a recent tier to their slots first
            for t in self.tiers:
                t.flush()
        parts = self._parts()
        pieces = [p for t in parts for p in t.store.pieces(t.filled)]
        pos_past = cat_slots([t.pos[:, :, : t.filled] for t in parts]).long()
        valid_past = cat_slots([t.valid[:, :, : t.filled] for t in parts])
        if self.pool is not None:  # one row for every head: each head sees its own slots only
            valid_past = self.pool.visible(parts, valid_past, self._padded or self.tiers[0].holes)
        if self.compact is not None:
            pieces, pos_past = self.compact.apply(pieces, pos_past, valid_past, self.n_real, self.keyspace)
        runs = [t.store.run(t.filled) for t in parts] if q_len == 1 and self.compact is None else None
        return _Segments(
            pieces=pieces,
            pos_past=pos_past,
            valid_past=valid_past if self._padded or self.shared > 1 or self.tiers[0].holes else None,
            k_new=k_new,
            v_new=v_new,
            pos_new=pos_new,
            valid_new=valid_new,
            runs=runs,
            summary=None if self.summary is None else self.summary.term(k_new.dtype),
            knorm_new=knorm_new,
            query=query if self.keyspace is not None else None,
        )

    def absorb(self, stats: dict, valid_new, pos_new) -> None:
        """Store the new tokens, evicting to the budget, after attention has scored everything."""
        assert self._new is not None and self.budget is not None, "absorb() follows update() and segments()"
        k_new, v_new = self._new
        self._new = None
        b, h, m, _ = k_new.shape
        self.n_real += m if valid_new is None else valid_new.sum(1)
        if self.prompt_end is None and self.policy.question:  # the first forward: the prompt, or its first chunk
            self.prompt_end = (self.n_real + ((self.prompt_len or m) - m)).view(-1, 1, 1)
        parts = self._parts()  # as segments() laid them out for attention
        n_past = sum(t.filled for t in parts)
        self._fit_positions(m)
        if valid_new is not None:  # a padding token's position is -1: a slot that holds no token
            pos_new = pos_new.masked_fill(~valid_new, -1)
        new = {"k": k_new, "v": v_new, "pos": pos_new.view(-1, 1, m).expand(b, h, m)}
        new.update({n: stats[n][..., n_past:] for n in self.tiers[0].stat_names})
        if self.pool is not None:
            stats, new = self.pool.pooled(stats, new, n_past, parts)
        offset, decay = 0, self.rows.decay()
        for tier in parts:
            tier.accumulate(stats, offset, decay, m, m * self._group if self._group else float("inf"))
            offset += tier.filled
        ctx = {
            "newest": (self.n_real - 1).view(-1, 1, 1),
            "budget": self.budget,
            "layer_idx": self.layer_idx,
            "prompt_len": self.prompt_end,
        }
        self.evicted += max(0, self.tiers[0].filled + m * self.shared - self.budget * self.shared) // self.shared
        merge = self.summary is not None
        # an unpadded decode step: rows advance together, so a tier out of room is full of tokens
        # in every row and what it evicts is real: no host read to cut it to its valid entries
        real = m == 1 and not self._padded
        gone = self.tiers[0].insert(
            self.rows,
            new,
            ctx,
            protected_newcomer=valid_new is None,
            want_evicted=len(self.tiers) > 1 or merge,
            all_real=real,
        )
        if len(self.tiers) > 1:  # what the first tier demotes goes to the second; what leaves that, on
            demoted, gone = gone, None
            # unpadded, every demoted entry is a real token: skip the host sync that checks it
            if demoted is not None and (not self._padded or bool((demoted["pos"] >= 0).any())):
                gone = self.tiers[1].insert(
                    self.rows, demoted, ctx, protected_newcomer=False, want_evicted=merge, all_real=real
                )
        if gone is not None and self.summary is not None:  # what left the last tier leaves the cache: into the summary
            self.summary.add(gone, self.shared)
        self.seen += m
        for tier in self.tiers:  # paged bookkeeping: no rectangle outlives the step
            tier.drop_views()
        self._expose()  # a tier that grew a page holds new tensors

    def _fit_positions(self, m: int) -> None:
        """Widen the positions to int32 once a row's own last position passes 32,767 (``n_real``
        already counts this step's tokens). ``longest`` bounds it on the host (every new entry
        counted, padding included); the exact count is read from the device only when that bound
        would widen, so neither padding nor a history that outlived its rows (``seen``) widens, and
        decoding far from the limit reads nothing."""
        self.longest += m
        if self.longest - 1 <= POS16_MAX or all(t.pos_dtype != torch.int16 for t in self.tiers):
            return
        self.longest = int(self.n_real.max())  # near the limit: one host read, then the bound is exact
        for tier in self.tiers:
            tier.widen_positions(self.longest - 1)
