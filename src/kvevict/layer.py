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

import torch
from transformers.cache_utils import CacheLayerMixin

from . import capture
from .attention import PaddingInfo, _Segments, hand_off
from .budget import resolve_budget
from .headpool import HeadPool, cat_slots
from .keyspace import KeySpace
from .layer_batch import BatchChanges
from .layer_state import PER_ROW, Handoff, LayerShape, LayerSpec, Progress, RowTensor, stand_ins
from .memory import MemoryPlan
from .merge import Summary
from .policies import Policy
from .policies.window import Windowed, window_recency
from .rope import CompactPositions
from .rows import Rows
from .storage import Storage, check_group
from .storage.rect import DenseStore
from .tier import Tier
from .turnover import slack_and_recent


class EvictingLayer(BatchChanges, CacheLayerMixin):
    """One decoder layer's budgeted key/value storage: one ``Tier`` of ``budget`` slots, or two for
    mixed precision (the evicted tokens demoted to ``evicted_bits`` instead of dropped)."""

    is_sliding = False
    # EvictingCache.compileable() turns it on per layer: generate then compiles a step by itself on CUDA
    is_compileable = False
    wide_positions = False  # compileable: int32 positions before a captured step (capture.wide_positions)
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
        self.spec = LayerSpec(policy, budget, layer_idx, inv_freq, storage or Storage(), window, pools, slack)
        # a memory plan's share: the first forward resolves its storage, and its recent tier's
        # bytes come out of its slots (still so once ``set_prompt_length`` resolved the budget)
        self.spec.memory_plan = isinstance(budget, MemoryPlan)
        self.spec.floor = budget.floor if isinstance(budget, MemoryPlan) else 0
        self._start()

    def _start(self) -> None:
        """The state of a layer that has seen nothing (``__init__``, ``reset``): its spec stays."""
        # compact positions (keys re-rotated to their rank each step), or None
        inv_freq = self.spec.inv_freq
        self.compact = None if inv_freq is None else CompactPositions(inv_freq)
        self.shape: LayerShape | None = None  # fixed by the first forward (``lazy_initialization``)
        self.tiers: list[Tier] = []
        self.progress = Progress()
        self.io = Handoff()
        # per-row state besides the tiers (``layer_state.PER_ROW``), made by the first forward
        self._n_real: RowTensor | None = None
        self._prompt_end: RowTensor | None = None  # (b, 1, 1) real prompt tokens per row, where the question ends
        self.rows: Rows | None = None
        self.summary: Summary | None = None  # the evicted tokens' mean slot (policy.merge)
        self.keyspace: KeySpace | None = None  # keys stored centred and rotated (low-bit storage)
        self.pool: HeadPool | None = None  # Ada-KV: the heads share one row of slots
        self._padded = False  # whether any slot may hold padding (then attention needs the mask)

    # -- what the layer was made with, and what its first forward fixed ----------------------
    policy = property(lambda self: self.spec.policy)
    layer_idx = property(lambda self: self.spec.layer_idx)
    window = property(lambda self: self.spec.window)
    pools = property(lambda self: self.spec.pools)
    slack = property(lambda self: self.spec.slack)

    @property
    def storage(self) -> Storage:
        assert self.spec.storage is not None
        return self.spec.storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self.spec.storage = storage

    @property
    def prompt_len(self) -> int | None:
        return self.spec.prompt_len

    @prompt_len.setter
    def prompt_len(self, n: int | None) -> None:
        self.spec.prompt_len = n

    @property
    def budget_spec(self):
        return self.spec.budget

    @budget_spec.setter
    def budget_spec(self, budget) -> None:  # resolved against the whole prompt (``set_prompt_length``)
        self.spec.budget = budget

    def _fixed(self) -> LayerShape:
        assert self.shape is not None, "the first forward fixes the layer's shape"
        return self.shape

    dtype = property(lambda self: self._fixed().dtype)
    device = property(lambda self: self._fixed().device)
    dims = property(lambda self: self._fixed().dims)
    shared = property(lambda self: self._fixed().shared)
    budget = property(lambda self: None if self.shape is None else self.shape.budget)
    recent_cost = property(lambda self: 0 if self.shape is None else self.shape.recent_cost)
    seen = property(lambda self: self.progress.count("seen"))
    evicted = property(lambda self: self.progress.count("evicted"))
    peak_entries = property(lambda self: self.progress.peak_entries)
    returned_keys = property(lambda self: self.io.returned_keys)

    @property
    def position_check(self):
        """The last decode step's positions check, read by the next forward (``input_checks``)."""
        return self.io.position_check

    @position_check.setter
    def position_check(self, check) -> None:
        self.io.position_check = check

    @property
    def n_real(self) -> torch.Tensor:
        """(b,) real tokens each row has been given."""
        assert self._n_real is not None, "the first forward makes the per-row state"
        return self._n_real.t

    @property
    def prompt_end(self) -> torch.Tensor | None:
        return None if self._prompt_end is None else self._prompt_end.t

    def _per_row(self) -> list:
        """The registry's holders this layer has (``layer_state.PER_ROW``), with whether their
        bytes are the cache's, in its order."""
        return [(h, counted) for name, counted in PER_ROW if (h := getattr(self, name)) is not None]

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, m, dk = key_states.shape
        dv = value_states.shape[-1]
        spec = self.spec
        if isinstance(spec.budget, MemoryPlan):  # a memory plan: a short prompt is kept at 16 bits
            spec.storage = spec.budget.storage_for(spec.prompt_len or m, self.storage)
        budget, policy = self._windowed(resolve_budget(spec.budget, m))
        policy.check(budget)
        st = self.storage
        check_group(st.group, dk, st.kv_bits)
        check_group(st.group, dv, st.kv_bits)
        # adaptive (Ada-KV): one row of h x budget slots per sequence, shared by the h heads
        self.pool = HeadPool(h, key_states.device) if policy.adaptive and h > 1 else None
        shared = 1 if self.pool is None else h
        self.shape = LayerShape(key_states.dtype, key_states.device, (h, dk, dv), shared, budget)
        slack, cost = slack_and_recent(
            spec, self.storage, budget, (dk, dv), self.dtype, policy.stats, shared > 1, self.compact is not None
        )
        recent = cost > 0
        if recent and self.spec.memory_plan:  # the slots a memory plan gave up
            self.shape.recent_cost = cost
            self.shape.budget -= cost
            policy.check(self.shape.budget)
        self.tiers = self._make_tiers(b, m, policy, slack, recent)
        self._n_real = RowTensor(torch.zeros(b, dtype=torch.long, device=self.device))
        self.rows = Rows(policy, self.shape.budget, b, self.device)  # every row: this policy and budget
        self.summary = self._summary(b, h, dk, dv)
        self.keyspace = KeySpace() if st.rotates_keys else None
        self._expose()
        self.is_initialized = True

    def _make_tiers(self, b: int, m: int, policy, slack: int, recent: bool) -> list[Tier]:
        """One tier of the budget's slots, and a low-bit one for the evicted tokens (mixed precision)."""
        st, (h, dk, dv), shared, budget = self.storage, self.dims, self.shared, self._fixed().budget
        args = (b, h // shared, dk, dv, self.dtype, self.device, policy.stats)
        kw = dict(group=st.group, heads=shared, pools=self.pools)
        tiers = [Tier(budget * shared, *args, bits=st.kv_bits, slack=slack, recent=recent, **kw)]
        if self.recent_cost:  # a memory plan spends its bytes from the start, as planned
            tiers[0].make_recent()
        if st.evicted_bits is None:
            return tiers
        check_group(st.group, dk, st.evicted_bits)
        check_group(st.group, dv, st.evicted_bits)
        if st.evicted_budget is not None:
            low = resolve_budget(st.evicted_budget, self.prompt_len or m)
        else:  # room for the rest of the prompt (past the first tier's slots, a recent tier's too)
            low = max(1, (self.prompt_len or m) - budget - self.recent_cost)
        if self.window is not None:  # both tiers together never hold more than the window
            low = min(low, self.window - 1 - budget)
        if low > 0:
            tiers.append(Tier(low * shared, *args, bits=st.evicted_bits, **kw))
        return tiers

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
        self.io.new = (key_states, value_states)
        held = sum(t.filled for t in self._parts()) // self.shared  # per (sequence, KV head), on average
        # entries this layer holds during this step: stored slots + the incoming tokens
        self.progress.peak_entries = max(self.progress.peak_entries, held + key_states.shape[2])
        t0 = self.tiers[0]
        if (
            len(self.tiers) == 1
            and self.shared == 1
            and isinstance(t0.store, DenseStore)
            and t0.store.keys.dtype == self.dtype
        ):
            keys, values = t0.store.keys[:, :, : t0.filled], t0.store.values[:, :, : t0.filled]
        else:  # packed, two tiers or shared: attention reads the tiers itself; hand back shape-only stand-ins
            keys, values = stand_ins(key_states, value_states, held)
        self.io.returned_keys = keys
        hand_off(self)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.progress.mask_seen() + query_length, 0

    def get_seq_length(self):
        return self.progress.seq_length()  # positions go on from every token seen, kept or evicted

    def get_max_length(self) -> int:
        return -1  # any number of tokens can stream through

    def reset(self) -> None:
        CacheLayerMixin.__init__(self)
        self._start()

    def _parts(self) -> list:
        """The tiers as attention reads them: each, then its recent tier's waiting tokens."""
        return [p for t in self.tiers for p in t.parts()]

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
        assert self.rows is not None
        return self.tiers[0].stat_names, self.rows.attention_params()

    def kv_bytes(self) -> int:
        """Every byte this layer holds: keys and values (codes, steps and zeros when packed),
        positions, validity, head ids (adaptive) and the policy's statistics of every tier."""
        if not self.is_initialized:
            return 0
        return sum(t.nbytes() for t in self.tiers) + sum(h.nbytes() for h, counted in self._per_row() if counted)

    def segments(self, value_view, info: PaddingInfo | None, q_len: int, query=None) -> _Segments:
        """What attention reads this forward: the stored slots and the new tokens. ``query``: with
        keys stored rotated, the queries are rotated with the new keys (``seg.query``)."""
        assert self.io.new is not None, "update() hands the new keys over before attention reads the segments"
        k_new, v_new = self.io.new
        if query is not None:
            self.io.group = query.shape[1] // k_new.shape[1]
        valid_new = None
        if info is not None and info.padding is not None:  # compiled: the mask covers seen + new (generate's)
            seen = info.padding.shape[-1] - q_len if torch.compiler.is_compiling() else self.seen
            valid_new = info.real_upto(seen + q_len)[:, seen:]
            self._padded = True
        knorm_new = None
        if self.keyspace is not None:  # stored and attended in the rotated basis (kvevict.keyspace)
            if "knorm" in self.tiers[0].stat_names:  # a key's norm, as the model made it
                knorm_new = k_new.float().norm(dim=-1)
            if query is None:
                k_new = self.keyspace.enter(k_new, valid_new)
            else:
                k_new, query = self.keyspace.enter_with_query(k_new, query, valid_new)
            self.io.new = (k_new, v_new)
        if valid_new is None and q_len == 1:  # a copy: absorb() advances n_real in place
            pos_new = self.n_real[:, None].clone()
        elif valid_new is None:
            pos_new = self.n_real[:, None] + torch.arange(q_len, device=self.device)
        else:
            pos_new = self.n_real[:, None] + valid_new.long().cumsum(1) - 1
        if q_len > 1:  # a prompt or a chunk: the tokens waiting in a recent tier to their slots first
            for t in self.tiers:
                t.flush()
        parts = self._parts()
        pieces = [p for t in parts for p in t.store.pieces(t.filled)]
        # unpadded and without holes every slot below the fill holds a token: no mask to build;
        # positions are read by a sliding window's mask and by compact positions only
        masked = self._padded or self.tiers[0].holes
        valid_past = pos_past = None
        if masked or self.window is not None or self.compact is not None:
            pos_all = cat_slots([t.pos[:, :, : t.filled] for t in parts])  # -1: an empty slot
            if masked or self.compact is not None:
                valid_past = pos_all >= 0
            if self.window is not None or self.compact is not None:
                pos_past = pos_all.long()
        if self.pool is not None:  # one row for every head: each head sees its own slots only
            valid_past = self.pool.visible(parts, valid_past, masked, keep=True)
        if self.compact is not None:
            assert valid_past is not None and pos_past is not None
            pieces, pos_past = self.compact.apply(pieces, pos_past, valid_past, self.n_real, self.keyspace)
        runs = [t.store.run(t.filled) for t in parts] if q_len == 1 and self.compact is None else None
        return _Segments(
            pieces=pieces,
            pos_past=pos_past,
            valid_past=valid_past if masked or self.shared > 1 else None,
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
        assert self.io.new is not None and self.rows is not None, "absorb() follows update() and segments()"
        k_new, v_new = self.io.new
        self.io.new = None
        b, h, m, _ = k_new.shape
        budget = self._fixed().budget
        self.n_real.add_(m if valid_new is None else valid_new.sum(1))
        if self._prompt_end is None and self.policy.question:  # the first forward: the prompt, or its first chunk
            self._prompt_end = RowTensor((self.n_real + ((self.prompt_len or m) - m)).view(-1, 1, 1))
        parts = self._parts()  # as segments() laid them out for attention
        n_past = sum(t.filled for t in parts)
        evicted = max(0, self.tiers[0].filled + m * self.shared - budget * self.shared) // self.shared
        self.progress.advance(m, evicted, self.device)
        self.progress.fit_positions(self.tiers, self.n_real)
        if valid_new is not None:  # a padding token's position is -1: a slot that holds no token
            pos_new = pos_new.masked_fill(~valid_new, -1)
        new = {"k": k_new, "v": v_new, "pos": pos_new.view(-1, 1, m).expand(b, h, m)}
        new.update({n: stats[n][..., n_past:] for n in self.tiers[0].stat_names})
        if self.pool is not None:
            stats, new = self.pool.pooled(stats, new, n_past, parts)
        offset, decay = 0, self.rows.decay()
        for tier in parts:
            tier.accumulate(stats, offset, decay, m, m * self.io.group if self.io.group else float("inf"))
            offset += tier.filled
        ctx = {
            # one unpadded token: its position is the newest (n_real counted it above)
            "newest": pos_new.view(-1, 1, 1) if m == 1 and valid_new is None else (self.n_real - 1).view(-1, 1, 1),
            "budget": budget,
            "layer_idx": self.layer_idx,
            "prompt_len": self.prompt_end,
        }
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
        for tier in self.tiers:  # paged bookkeeping: no rectangle outlives the step
            tier.drop_views()
        self._expose()  # a tier that grew a page holds new tensors
        if self.is_compileable:
            capture.prepare(self)

    def skip(self, m: int) -> None:
        """Positions go on past ``m`` tokens this sliding layer never held, as if its window had
        evicted them (``kvevict.prefill.fill_from``); between ``update`` and ``segments``."""
        if self.window is None:
            raise ValueError("only a sliding-window layer can skip tokens: a full layer keeps or ranks every one.")
        self.n_real.add_(m)
        self.progress.skip(m)
