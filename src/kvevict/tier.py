"""One tier of an eviction layer: up to ``budget`` slots per (sequence, KV head) holding keys and
values (in a ``store``, full precision or packed) plus each token's position (-1: an empty slot or
padding, so validity costs no byte of its own) and the policy's statistics. The slot machinery is
written once, here: new tokens fill free slots, and once the tier is full they take the slots of
the lowest-priority candidates, overwriting them in place.

Storage grows in pages: the tier starts empty and allocates ``PAGE`` slots at a time as tokens
arrive, never past its budget, so a short chat under a large budget holds only its own tokens
(rounded up to a page), as the stock cache would. Padding takes no slot: in a batch of prompts of
different lengths each row stores its own tokens only (``_append``). ``capacity`` is the allocated width;
``budget`` the most it may grow to. Rows that leave a shared batch give their pages back
(``fit``). Growth copies the tier once per page (amortised: a 2K-token tier copies 2K slots every
``PAGE`` steps, against 2K slots read by attention every step).
With ``pools`` (a ``kvevict.storage.Pools``, the server's) every per-slot tensor is each row's own
pages of a shared pool instead of one rectangle: the keys and values (``PagedStore``) and the
bookkeeping, positions, head ids and statistics (``PagedField`` each), so a short row beside a
long one holds its own pages only. The policy still ranks a (b, h, capacity) rectangle of the
bookkeeping: laid out when first read in a step and dropped at the next write, never held.

A layer has one tier, or two for mixed precision (MiKV, Yang et al. 2024, "No Token Left Behind"):
the tokens the first tier evicts are demoted into a second, low-bit tier instead of being
dropped, and that tier evicts by the same policy once its own budget is full.

A shared tier (Ada-KV's head-adaptive budgets, ``heads`` > 1) has one row of ``budget`` slots per
sequence for all its KV heads: each slot also records whose it is ("head", uint8), candidates of
every head compete in one ranking, and a head holds as many slots as it wins.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .caps import RowCaps
from .policies import Candidates
from .replace import evicted, replace_many, replace_one
from .rows import Rows
from .stats import FP16_MAX, STATS, stat_dtype
from .storage import paged
from .storage.layout import POS16_MAX, SlotLayout
from .storage.paged import PagedField, PagedStore, page_slots
from .storage.rect import RectField, make_store
from .tier_batch import TierBatch
from .turnover import Turnover

# per-candidate metadata besides the key/value pair: position (-1: not a token), one entry per statistic
_META = ("pos",)


class Tier(TierBatch):
    def __init__(
        self,
        budget: int,
        b,
        h,
        dk,
        dv,
        dtype,
        device,
        stats: tuple,
        bits=None,
        group: int = 32,
        heads: int = 1,
        pools=None,
        slack: int = 1,
        recent: bool = False,
    ):
        self.budget, self.filled, self.heads = budget, 0, heads
        # batch eviction: once full, one ranking frees ``slack`` slots per entry a step brings and
        # the next ``slack - 1`` steps write into them unranked (``kvevict.turnover``); 1: every step ranks
        packed = recent and slack > 1 and bits in (8, 4, 2)
        self.turnover = Turnover(
            slack, ((slack - 1) * heads, h, dk, dv, dtype, device, tuple(stats), heads) if packed else None
        )
        self.capacity = 0  # slots allocated: pages, grown on demand up to ``budget``
        # the fill level, per row and of the widest row (``set_fills`` sets them together):
        # ``row_fills``, each row's used slots on the host (a row writes its next tokens at its own
        # fill, so rows that joined a batch at different lengths leave no holes), ``row_fills_dev``
        # its device mirror (the write index); ``filled``, the most any row used: what attention reads
        self.row_fills = [0] * b
        self.row_fills_dev = torch.zeros(b, dtype=torch.long, device=device)
        # rows of a shared batch may have smaller budgets than the tier is wide (``kvevict.caps``);
        # None: every row has the tier's budget
        self._caps: RowCaps | None = None
        self.pools, self.h, self.device = pools, h, device
        # what a slot holds and where (``storage.layout``): the bytes counted, the statistics kept
        self.layout = SlotLayout(
            dk,
            dv,
            bits,
            group,
            dtype.itemsize,
            tuple(stats),
            heads > 1,
            None if pools is None else pools.page or paged.PAGE,
        )
        if pools is None:  # one rectangle: every row as wide as the widest
            self.store = make_store(b, h, 0, dk, dv, dtype, device, bits, group)
        else:  # each row its own pages of a shared pool (kvevict.storage.paged)
            self.store = PagedStore(
                pools, b, h, dk, dv, torch.float16 if bits == 16 else dtype, dtype, device, bits, group
            )
        # per-slot bookkeeping, by name: a (b, h, capacity) tensor, or a PagedField on ``pools``
        self._meta = {"pos": self._field(b, torch.int16, -1)}
        if heads > 1:  # shared by the heads: whose each slot is
            self._meta["head"] = self._field(b, torch.uint8, 0)
        for n in stats:
            self._meta[n] = self._field(b, stat_dtype(n), 0)

    def _field(self, b, dtype, empty):
        """A new per-slot tensor of ``b`` rows, every slot ``empty``, as many slots as the tier's."""
        if self.pools is None:
            return RectField(torch.full((b, self.h, self.capacity), empty, dtype=dtype, device=self.device), empty)
        f = PagedField(self.pools, b, self.h, dtype, empty, self.device)
        f.resize(self.capacity)
        f.ensure(self.row_fills)
        return f

    @property
    def pos(self) -> torch.Tensor:
        """(b, h, capacity) each slot's position, -1 where it holds no token."""
        return self.meta("pos")

    @property
    def head(self) -> torch.Tensor:
        """(b, h, capacity) a shared tier's: whose head each slot is."""
        return self.meta("head")

    @property
    def stats(self) -> dict:
        return {n: self.meta(n) for n in self.layout.stats}

    @property
    def bookkeeping(self) -> dict:
        """Each per-slot tensor besides keys and values, by name: a RectField, or a PagedField."""
        return dict(self._meta)

    @property
    def stat_names(self) -> tuple:
        return self.layout.stats

    @property
    def pos_dtype(self):
        return self._meta["pos"].dtype

    @property
    def valid(self) -> torch.Tensor:
        """(b, h, capacity) whether a slot holds a token."""
        return self.pos >= 0

    def keep_stats(self, wanted) -> None:
        """Drop the statistics not in ``wanted`` (only rows that left read them)."""
        for n in self.layout.stats:
            if n not in wanted:  # a paged one's pages back to the pool now, not at collection
                field = self._meta.pop(n)
                field.resize(0)
                field.disown()
        self.layout = replace(self.layout, stats=tuple(n for n in self.layout.stats if n in wanted))

    def widen_positions(self, last: int) -> None:
        """Make room for positions up to ``last`` (int16 -> int32 once a sequence passes 32,767)."""
        if last > POS16_MAX and self.pos_dtype == torch.int16:
            self._meta["pos"] = self._meta["pos"].astype(self.pools, torch.int32)
        if self.turnover.recent is not None:
            self.turnover.recent.widen_positions(last)

    def narrow_positions(self, last: int) -> None:
        """Back to int16 once every position held is at most ``last`` <= 32,767 (the rows past it left)."""
        if last <= POS16_MAX and self.pos_dtype != torch.int16:
            self._meta["pos"] = self._meta["pos"].astype(self.pools, torch.int16)

    def slot_tensors(self) -> list:
        """A rectangle's per-slot tensors (keys and values, then the bookkeeping); a paged tier's
        are its pool's pages (none listed)."""
        out: list = []

        def collect(t):
            out.append(t)
            return t

        if self.pools is None:
            self._map_slots(collect)
        return out

    def meta(self, name: str) -> torch.Tensor:
        return self._meta[name].rect(self.capacity)

    def names(self):
        return (*_META, *(("head",) if self.heads > 1 else ()), *self.layout.stats)

    def drop_views(self) -> None:
        """Paged: forget the bookkeeping rectangles laid out this step (a tier that took no token
        this step was not written, so nothing else drops them): none is held between steps."""
        for f in self._meta.values():
            f.drop_view()

    def disown(self) -> None:
        """Paged: this tier's rows were appended to another cache's; their pages are that one's now."""
        self.store.disown()
        for f in self._meta.values():
            f.disown()

    def accumulate(self, stats: dict, offset: int, decay: float, m: int, added: float = float("inf")) -> None:
        """Add this step's statistics of this tier's slots (columns [offset, offset + filled)).
        ``added``: the most a statistic can grow by in this forward (``m`` queries x the query heads
        of a KV head, each a probability or a 0/1 hit). Below 16 a float16 sum cannot pass its
        maximum: 65504 + 16 would round to inf, anything less rounds back to 65504 (float16's step is
        32 up there), so the clamp below is skipped, as in every decode step."""
        f = self.filled
        for name in self.layout.stats:
            st = self.meta(name)
            got = stats[name][..., offset : offset + f]
            fold = STATS[name].fold
            # in place on the view: ``st[..., :f] += got`` would copy the slice back onto itself
            if fold == "set":
                st[..., :f].copy_(got)
            elif fold == "decay":  # older values fade: a history of about 1 / (1 - gamma) steps
                st[..., :f].mul_(decay**m).add_(got)
            else:
                st[..., :f].add_(got)
            if st.dtype == torch.float16 and added >= 16:  # a sum past float16's range stays the largest, not inf
                st[..., :f].clamp_(max=FP16_MAX)
            self._meta[name].sync()  # paged: the rectangle is a copy of the pages

    def candidates(self, new: dict | None, newest, budget: int, layer_idx: int, prompt_len=None) -> Candidates:
        """All slots (empty ones invalid) followed by the new entries; the slots alone if ``new`` is None."""
        cat = {n: self.meta(n) if new is None else torch.cat([self.meta(n), new[n]], dim=-1) for n in self.names()}
        return Candidates(
            stats={n: cat[n].float() for n in self.layout.stats},
            pos=cat["pos"].long(),
            valid=cat["pos"] >= 0,
            newest=newest,
            budget=budget,
            layer_idx=layer_idx,
            head=cat.get("head"),
            heads=self.heads,
            prompt_len=prompt_len,
        )

    def insert(
        self, policy: Rows, new: dict, ctx: dict, protected_newcomer: bool, want_evicted: bool, all_real: bool = False
    ):
        """Store ``new`` entries (keys "k", "v" and the metadata, each (b, h, m, ...); "pos" -1 for
        padding); return the entries that left (evicted candidates, valid first) when
        ``want_evicted``, else None. ``all_real``: the caller knows that every slot of a row out of
        room and every new entry holds a token (an unpadded decode step), so what leaves is never
        cut to its valid entries (a host read)."""
        m = new["pos"].shape[-1]
        caps = (None if self._caps is None else self._caps.host) or [self.budget] * len(self.row_fills)
        real, adds = self._padding(new["pos"], caps, all_real)
        turned = False
        fills = [min(c, f + a) for f, c, a in zip(self.row_fills, caps, adds)]  # every row takes its free slots first
        self.reserve(max(fills) if fills else 0)
        if fills != self.row_fills and self._crosses(fills):  # a row grows into a page: paged holders give it first
            self.store.ensure(fills)
            for f in self._meta.values():
                f.ensure(fills)
        gone = None
        if all(f + a <= c for f, c, a in zip(self.row_fills, caps, adds)):  # room everywhere: append at each row's fill
            self._append(new, real)
        elif self.slack > 1 and all_real and self.caps is None and all(f >= c for f, c in zip(self.row_fills, caps)):
            gone = self.turnover.step(self, policy, new, ctx, protected_newcomer, want_evicted)
            turned = True
        elif m == 1:
            # a row with room: its free slots rank -inf and the first (its fill) is taken
            gone = self._replace_one(policy, new, ctx, protected_newcomer, want_evicted)
        else:
            gone = self._replace_many(policy, new, ctx, want_evicted, all_real)
        if fills != self.row_fills:  # a full cache decoding (the steady state) changes nothing here
            self.set_fills(fills)
        if not turned:  # the steps between rankings are over: their tokens to their slots
            self.flush()
        return gone

    def _crosses(self, fills: list[int]) -> bool:
        """Whether a row's new fill passes into a page it has not reached: only then can a paged
        holder (store or field, every one a page of the same size, each already holding the pages of
        the old fills) give out pages, so the holders' own per-row loops run once in ``page`` steps
        instead of every step. A rectangle's slots exist already: never."""
        page = self.layout.page
        if page is None:
            return False
        return any(-(-f // page) > -(-o // page) for f, o in zip(fills, self.row_fills))

    def _padding(self, pos: torch.Tensor, caps: list[int], all_real: bool) -> tuple[torch.Tensor | None, list[int]]:
        """(which of the new entries are tokens (b, m), or None; the slots each row's entries
        take). Padding takes no slot when some entries are padding (a batch of prompts of different
        lengths) and every row appends: room for its tokens, and past them for its padding's
        unwritten entries. Else every entry takes a slot (padding ranked first to go). Decoding
        (one entry per row, or ``all_real``: a batch eviction's tokens) reads nothing from the device."""
        m = pos.shape[-1]
        every = [m] * len(self.row_fills)
        if m == 1 or self.heads > 1 or all_real:  # a pooled tier's entries are (token, head) pairs: stored as given
            return None, every
        real = pos[:, 0] >= 0
        if bool(real.all()):
            return None, every
        counts = real.sum(-1).tolist()
        width = max(
            self.capacity, page_slots(max(min(c, f + a) for f, c, a in zip(self.row_fills, caps, counts)), self.budget)
        )
        if any(f + a > c or f + m > width for f, c, a in zip(self.row_fills, caps, counts)):
            return None, every
        return real, counts

    def _append(self, new: dict, real: torch.Tensor | None) -> None:
        """Write the new entries at each row's fill. Padding takes no slot (``real``): a row's tokens
        go to its next slots in order, its padding entries are not written (``take`` False) at the
        slots after them, so no two entries share a slot; a row holds its own tokens, as alone."""
        b, h, m = new["pos"].shape
        if real is None:
            self.write(
                (self.row_fills_dev.view(-1, 1, 1) + torch.arange(m, device=self.device)).expand(b, h, m), new, None
            )
            return
        r = real.long()
        rank = torch.where(real, r.cumsum(-1) - 1, r.sum(-1, keepdim=True) + (1 - r).cumsum(-1) - 1)
        idx = (self.row_fills_dev.view(-1, 1) + rank).view(b, 1, m).expand(b, h, m)
        self.write(idx, new, real.view(b, 1, m).expand(b, h, m))

    def set_fills(self, fills: list[int]) -> None:
        """Each row's fill level: ``row_fills`` (host), ``row_fills_dev`` (device) and ``filled``,
        their largest, set together."""
        self.row_fills = fills
        self.row_fills_dev = torch.tensor(fills, dtype=torch.long, device=self.device)
        self.filled = max(fills) if fills else 0

    def priority(self, policy, new: dict | None, ctx: dict) -> torch.Tensor:
        """The policy's priority of every slot (and new entry). Slots past a row's cap are +inf:
        never a victim, so never written; the policy never sees them (rows are ranked in groups
        sharing a cap, on their own slots only), so a score that mixes neighbours (SnapKV's
        pooling) is the same as in a tier of the row's own width."""
        c = self.candidates(new, **ctx)
        return policy.priority(c) if self._caps is None else self._caps.priority(policy, c, self.capacity)

    def write(self, idx, new: dict, take) -> None:
        self.store.write(idx, new["k"], new["v"], take)
        for name in self.names():
            self._meta[name].write(idx, new[name], take)

    def read(self, idx) -> dict:
        k, v = self.store.read(idx)
        out = {"k": k, "v": v}
        out.update({name: self.meta(name).gather(2, idx) for name in self.names()})
        return out

    def _replace_one(self, policy, new, ctx, protected_newcomer, want_evicted):
        return replace_one(self, policy, new, ctx, protected_newcomer, want_evicted)

    def _replace_many(self, policy, new, ctx, want_evicted, all_real=False):
        return replace_many(self, policy, new, ctx, want_evicted, all_real)

    def flush(self) -> None:
        """The recent tier's tokens to their slots (``Turnover.flush``)."""
        self.turnover.flush(self)

    def settle(self) -> None:
        """Before the batch changes: no turn-over in progress (``Turnover.settle``)."""
        self.turnover.settle(self)

    def make_recent(self) -> None:
        self.turnover.make_recent(self)

    @property
    def slack(self) -> int:
        return self.turnover.slack

    @property
    def holes(self) -> bool:
        """Some slot below a row's fill holds no token (freed by a batch eviction): attention masks it."""
        return self.turnover.holes

    @property
    def recent(self) -> "Tier | None":
        return self.turnover.recent

    def put(self, j: int, new: dict) -> None:
        """Write entries ``new`` (b, h, m) at columns j .. j + m of every row: slices, no index (a
        recent tier, which every row fills alike)."""
        m = new["pos"].shape[-1]
        self.store.keys[:, :, j : j + m] = new["k"]
        self.store.values[:, :, j : j + m] = new["v"]
        for name in self.names():
            self.meta(name)[..., j : j + m] = new[name]
        self.set_fills([j + m] * len(self.row_fills))

    def evicted(self, out, new: dict, all_real: bool = False) -> dict:
        return evicted(self, out, new, all_real)

    def reserve(self, n: int) -> None:
        """Allocate the pages ``n`` tokens need (never past the budget); the new slots are empty."""
        self.grow_to(page_slots(n, self.budget))

    def grow_to(self, n: int) -> None:
        if n > self.capacity:
            self._resize(n)

    def _resize(self, n: int) -> None:
        """Reallocate every per-slot tensor to ``n`` slots (cut, or padded with empty slots)."""
        extra = n - self.capacity

        def fn(t):
            if extra < 0:
                return t[:, :, :n].clone()  # a view would keep the whole old storage alive
            return torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2)

        self.store.resize(n, fn)
        for f in self._meta.values():  # the new slots are empty
            f.resize(n, fn)
        self.capacity = n
        if self.filled > n:  # cut below a row's fill (the budget shrank to the widest cap)
            self.set_fills([min(f, n) for f in self.row_fills])

    def nbytes(self) -> int:
        """Every byte this tier holds: keys and values (codes, steps, zeros), positions, statistics,
        and its recent tier's."""
        rows = len(self.row_fills)
        if self.pools is None:
            own = self.layout.rect_bytes(rows, self.h, self.capacity, self.pos_dtype)
        else:  # every per-slot tensor holds the same pages of each row, and a table as wide
            store = self.store
            assert isinstance(store, PagedStore)
            own = self.layout.paged_bytes(sum(store.own), self.h, rows, store.table.shape[1], self.pos_dtype)
        return own + self.turnover.nbytes()

    def parts(self) -> list:
        """What attention reads of this tier: itself, then its recent tier's tokens if it holds any."""
        return [self] if self.recent is None or not self.recent.filled else [self, self.recent]
