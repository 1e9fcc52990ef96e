"""Admission: which waiting requests start now, and which of them are prefilled in one forward.

Requests wait in ``pending``, oldest first. One starts while fewer than ``max_batch`` sequences run
and its K/V bytes fit ``Settings.kv_memory`` beside the running rows': every batch bounded as
``Budgeter.batch_bytes`` counts it (paged), plus page 0 of each page pool it would open and the
pools' idle pages. The oldest that does not fit blocks the rest, so nobody starves. The prefix
store's bytes (``prefix_store``) count too, and so does a copy of each newcomer's prompt prefix it
will store; the store gives up prefixes, least recently used first, when that lets a request in.
"""

from __future__ import annotations

from collections import deque

from ..storage import Pools
from .budgeter import Budgeter, spec_policy
from .handle import Handle, Running, joins, scores_prompt
from .metrics import Metrics
from .prefix_store import PrefixStore, prefix_spec
from .settings import Settings

PREFILL_TOKENS_PER_STEP = 2048  # prompt tokens prefilled between two decode steps (at least one prompt)


class Admission:
    def __init__(
        self,
        settings: Settings,
        budgeter: Budgeter,
        pages: Pools,
        metrics: Metrics,
        log: deque,
        running: list[Running],
        store: PrefixStore | None = None,
    ):
        self.settings, self.budgeter, self.pages, self.metrics, self.log = settings, budgeter, pages, metrics, log
        self.store = store  # stored prompt prefixes: counted against kv_memory, and evicted for a request
        self.running = running  # the engine's running batches (the same list, changed by the decoder)
        self.pending: deque[Handle] = deque()
        self.opened: set = set()  # keys of the page pools open (Budgeter.opening): their page 0 is idle bytes

    def drop_gone(self, now: float) -> None:
        """Waiting requests whose client went away or whose deadline passed leave the queue."""
        gone = [h for h in self.pending if h.cancelled.is_set() or h.expired(now)]
        for h in gone:
            self.pending.remove(h)
            timed_out = not h.cancelled.is_set()
            if timed_out:
                h.push_timeout()
            self.log.append(
                {"event": "timeout" if timed_out else "cancelled", "id": h.req.id, "t": now, "queued": True}
            )
            self.metrics.add("kvevict_requests_total", outcome="timeout" if timed_out else "cancelled")

    def take(self) -> list[Handle]:
        """Waiting requests that fit now, oldest first, at most ``PREFILL_TOKENS_PER_STEP`` prompt
        tokens of them (at least one prompt); the engine calls it under its lock."""
        s = self.settings
        taken, tokens, compacted = [], 0, False
        running = sum(len(run.rows) for run in self.running)
        while self.pending and running + len(taken) < s.max_batch and tokens < PREFILL_TOKENS_PER_STEP:
            need, stored = self.need([*taken, self.pending[0]]), self.stored()
            if need + stored + self.pages.idle_bytes() > s.kv_memory:
                if compacted or need + stored + self.pages.zero_bytes() > s.kv_memory:
                    # stored prefixes give way to a request, least recently used first, when that
                    # makes room; their pages are free then, and a compaction gives them back
                    room = s.kv_memory - need - self.pages.zero_bytes()
                    if self.store is None or room < 0 or not self.store.shrink(room):
                        break
                    compacted = False
                    continue
                # free pages of some pool stand in the way: every pool gives its free pages back
                # (between steps, no view of the pages is live), then the request fits
                self.pages.compact()  # a pool no row used is gone: only the running rows' stay open
                self.opened = {
                    key
                    for run in self.running
                    for r in run.rows
                    for key in self.budgeter.opening(*_pools(r.handle.spec))
                }
                compacted = True
                continue
            h = self.pending.popleft()
            taken.append(h)
            tokens += len(h.req.prompt_ids)
        self.opened.update(key for h in taken for key in self.budgeter.opening(*_pools(h.spec)))
        self.pages.reserved = self.bound(taken) + self.stored() + sum(self.stores(h) for h in taken)
        self.metrics.set("kvevict_queued_requests", len(self.pending))
        return taken

    def stored(self) -> int:
        """Bytes the prefix store holds (a part of kv_memory)."""
        return 0 if self.store is None else self.store.nbytes

    def bound(self, extra: list[Handle] = ()) -> int:
        """The most bytes the running batches can hold, with each of ``extra`` joining the batch
        ``Decoder.start`` will put it in."""
        batches = [[r.handle.spec for r in run.rows] for run in self.running]
        for h in extra:
            for specs in batches:
                if joins(specs, h.spec):
                    specs.append(h.spec)
                    break
            else:
                batches.append([h.spec])
        return sum(self.budgeter.batch_bytes(specs, paged=True) for specs in batches)

    def need(self, extra: list[Handle]) -> int:
        """What admitting ``extra`` asks of kv_memory besides the pools' idle pages: the running and
        admitted rows' bound (``bound``) and the page 0 of every pool the newcomers would open."""
        opening = {}
        for h in extra:
            for key, n in self.budgeter.opening(*_pools(h.spec)).items():
                if key not in self.opened:
                    opening[key] = max(opening.get(key, 0), n)
        # and a copy of each newcomer's prompt prefix, for the prefix store (``Handle.stores``)
        return self.bound(extra) + sum(opening.values()) + sum(self.stores(h) for h in extra)

    def stores(self, h: Handle) -> int:
        """Bytes ``h`` reserves for storing its prompt's prefix: none when that is stored already.
        Looking makes the prefix it would reuse the most recently used, so that the store gives
        up others first to let it in."""
        if not h.stores:
            return 0
        req = h.req
        hit = self.store.lookup(req.owner, prefix_spec(req, self.settings.kv_bits), req.prompt_ids, count=False)
        return 0 if hit is not None and hit.length >= req.prefix_len else h.stores

    def groups(self, handles: list[Handle]) -> list[list[Handle]]:
        """Admitted requests that are prefilled in one forward: the same policy, budget and recent
        window, in arrival order; prompts that enter every layer without evicting apart from longer
        ones (a short prompt's padding then takes no slot: it holds only its own pages), and an
        Ada-KV prompt only with prompts of its length (a pooled tier stores padding)."""
        groups: dict[tuple, list[Handle]] = {}
        for h in handles:
            p, budget, recent, _ = h.spec
            n = len(h.req.prompt_ids)
            pol = None if p == "full" else spec_policy(p, recent)
            key = (
                (p,)
                if p == "full"
                else (
                    p,
                    budget,
                    recent,
                    self.budgeter.fits(pol, budget, n),
                    n if getattr(pol, "adaptive", False) else None,
                )
            )
            key += (scores_prompt(h.req),)  # those prefills keep every position's logits: apart
            groups.setdefault(key, []).append(h)
        return list(groups.values())


def _pools(spec: tuple) -> tuple:
    """(policy, recent, length) of a row's ``spec``: what decides the page pools it opens."""
    return spec[0], spec[2], spec[3]
