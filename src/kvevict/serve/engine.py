"""The engine: a queue of requests, continuous batching, and one worker thread that runs every
model call and streams tokens back to each request's asyncio queue.

Each loop of the worker (1) admits waiting requests, oldest first, while their K/V bytes fit
``Settings.kv_memory`` and fewer than ``max_batch`` sequences run (``admission``; ``memory.Budgeter``
bounds the bytes); admitted prompts of one policy and budget are prefilled together in one forward,
each gives its first token at once, and they join the running batch: one ``EvictingCache`` holds
rows of any policies and budgets (each evicts by its own), and full-cache rows share a batch of
their own; (2) steps every running batch by one token (``decode``). A sequence that ends (EOS,
max_tokens, stop string), whose client went away or whose deadline (``request_timeout``) passed
leaves its batch at the next step and its storage is freed, so a waiting request can take its
place. With ``prefix_cache_memory`` a request whose prompt begins with a stored prefix prefills
only the rest (``prefix_store``, ``prefix_fill``). At most ``max_queue`` requests wait (429 past it); a draining engine (SIGTERM, ``drain``)
refuses new ones (503) and finishes those it has.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..attention import ATTN_NAME, register
from ..storage import Pools
from . import heap
from .admission import Admission
from .budgeter import Budgeter
from .decode import Decoder
from .errors import BadRequest
from .handle import Handle, Running
from .metrics import Metrics
from .prefix_fill import PrefixFill
from .prefix_store import PrefixStore
from .protocol import GenRequest
from .settings import Settings
from .work import Work

__all__ = ["Engine", "Handle"]


class Engine:
    """The queue and the worker thread; ``Admission`` decides who starts, ``Decoder`` runs them,
    ``Work`` holds who waits and who runs under the lock both threads share."""

    def __init__(self, model, tokenizer, settings: Settings, metrics: Metrics | None = None):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.metrics = metrics or Metrics()
        # stored prompt prefixes (``prefix_store``), their pages in the rows' pools: a part of kv_memory
        self.prefixes = self._prefix_store(settings)
        self.context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.log: deque[dict] = deque(maxlen=10_000)  # admissions, joins, finishes: for inspection and tests
        self.loops = 0  # worker loops so far: how soon a cancelled row leaves is counted in them
        self.trims = 0  # times the idle worker gave the freed heap back to the OS (``heap``)
        self.received = 0  # requests taken into the queue so far (tests wait on it)
        self._thread = threading.Thread(target=self._run, name="kvevict-engine", daemon=True)
        # one attention implementation for every policy, "full" included (exact with a DynamicCache)
        register()
        model.set_attn_implementation(ATTN_NAME)
        self.budgeter = Budgeter(model, settings.kv_bits)
        # every budgeted row's keys and values: its own pages of these pools (kvevict.storage.paged)
        self.pages = Pools(limit=settings.kv_memory)
        running: list[Running] = []
        self.admission = Admission(settings, self.budgeter, self.pages, self.metrics, self.log, running, self.prefixes)
        self.work = Work(self.admission.pending, running)
        fill = None if self.prefixes is None else PrefixFill(model, settings, self.pages, self.prefixes, self.log)
        self.decoder = Decoder(
            model,
            tokenizer,
            settings,
            self.budgeter,
            self.pages,
            self.metrics,
            self.log,
            running,
            freed=self.work.notify,  # memory was freed: the next admission sees it
            loops=lambda: self.loops,
            prefixes=fill,
        )
        if settings.budget is None:
            settings.budget = self.default_budget()
        self.metrics.set("kvevict_kv_memory_bytes", settings.kv_memory)
        self.metrics.set("kvevict_prefix_cache_memory_bytes", settings.prefix_cache_memory)

    def _prefix_store(self, settings: Settings) -> PrefixStore | None:
        limit = settings.prefix_cache_memory
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < settings.kv_memory:
            raise ValueError(
                f"prefix_cache_memory (--prefix-cache-memory) is the part of kv_memory ({settings.kv_memory} "
                f"bytes) stored prompt prefixes may hold: a size below it, or 0 to turn the store off; "
                f"got {limit!r}."
            )
        return PrefixStore(limit, self.metrics) if limit else None

    def default_budget(self) -> int:
        """Tokens per layer and KV head one sequence may keep: its share of ``kv_memory`` when
        ``min(max_batch, budget_share)`` sequences hold it (a multiple of 64, at least
        ``min_budget``, at most the context). The share is counted in the default policy's own
        bytes per slot, its state included. Shorter sequences hold only their own pages, so many
        more than that run at once."""
        s = self.settings
        per_token, rest = self.budgeter.per_token(s.policy)
        share = (s.kv_memory // min(s.max_batch, s.budget_share) - rest) // per_token
        return max(s.min_budget, min(self.context, share // 64 * 64))

    # -- the event loop's side ------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        """Draining (SIGTERM): new requests get 503, those admitted or waiting finish."""
        return self.work.draining

    def stop(self, timeout: float = 10.0) -> None:
        self.work.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def reserve_bytes(self, req: GenRequest) -> int:
        """The most K/V bytes ``req`` holds; a BadRequest when that alone exceeds ``kv_memory``."""
        if req.policy != "full" and req.policy not in self.budgeter.slots_of:
            raise BadRequest(f"kv_policy {req.policy!r} cannot serve requests.", "kv_policy")
        length = len(req.prompt_ids) + req.max_tokens
        need = self.budgeter.batch_bytes([(req.policy, req.budget_tokens, req.recent, length)], paged=True)
        need += self.budgeter.opening_bytes(req.policy, req.recent, length)  # alone, its pools' pages 0 too
        if need > self.settings.kv_memory:
            what = "lower max_tokens or shorten the prompt" if req.policy == "full" else "lower kv_budget"
            raise BadRequest(
                f"this request needs {need} bytes of K/V storage, more than the server's "
                f"kv_memory of {self.settings.kv_memory} bytes; {what}.",
                "max_tokens" if req.policy == "full" else "kv_budget",
            )
        return need

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs (a drain is over)."""
        return self.work.idle

    def drain(self) -> None:
        """Refuse new requests from now on (503); those already here go on (``idle`` says when done)."""
        self.work.drain()

    def prefix_bytes(self, req: GenRequest, reserve: int) -> int:
        """The most a copy of ``req``'s prompt prefix holds in the prefix store (what admission
        reserves for it beside the request); 0 when it stores none, or when the two would not fit
        kv_memory together (the request is then served without storing its prefix)."""
        if self.prefixes is None or not req.prefix_cache or req.prefix_len is None:
            return 0
        row = (req.policy, req.budget_tokens, req.recent, req.prefix_len)
        need = self.budgeter.batch_bytes([row], paged=True)
        return need if need <= self.settings.prefix_cache_memory and reserve + need <= self.settings.kv_memory else 0

    def submit(self, req: GenRequest, loop) -> Handle:
        reserve = self.reserve_bytes(req)
        handle = Handle(req, loop, reserve, self.settings.request_timeout, lambda: self.loops)
        handle.stores = self.prefix_bytes(req, reserve)
        work = self.work
        with work.cond:
            if work.draining or work.stopping:
                raise BadRequest(
                    "the server is shutting down and takes no new requests; send this one to "
                    "another replica, or retry once it is back.",
                    status=503,
                    type="service_unavailable",
                    headers={"Retry-After": "5"},
                    outcome="draining",
                )
            if len(work.pending) >= self.settings.max_queue:
                # 429 + Retry-After: clients (the openai one included) back off and retry; one second
                # is about a decode step's worth of rows leaving at the defaults
                raise BadRequest(
                    f"the server is overloaded: {len(work.pending)} requests already wait for "
                    f"memory (--max-queue {self.settings.max_queue}); retry after a moment.",
                    status=429,
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                    outcome="overloaded",
                )
            work.pending.append(handle)
            self.received += 1
            self.metrics.set("kvevict_queued_requests", len(work.pending))
            work.cond.notify_all()
        return handle

    # -- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                self.loops += 1
                admitted = self._admit()
                if admitted is None:
                    break
                for group in self.admission.groups(admitted):
                    self.decoder.start(group)
                with self.work.cond:  # each one runs now, or has ended
                    self.work.starting = 0
                self.decoder.step_all()
                self._gauges()
        for run in self.work.running:
            for r in run.rows:
                r.handle.push(("error", "the server is shutting down.", 503))
        self.work.running.clear()
        self._gauges()

    def _admit(self) -> list[Handle] | None:
        """Waiting requests that fit now (``Admission.take``), after waiting for work; None when
        the server stops."""
        trimmed, work = False, self.work
        while True:
            with work.cond:
                if work.stopping:
                    for h in work.pending:
                        h.push(("error", "the server is shutting down.", 503))
                    work.pending.clear()
                    return None
                self.admission.drop_gone(time.monotonic())
                if work.running or work.pending:
                    taken = self.admission.take()
                    work.starting = len(taken)
                    return taken
                if trimmed:
                    work.cond.wait(0.5)
                    continue
            # idle from now: what the work freed goes back to the OS, outside the lock so that a
            # request arriving meanwhile is not held up by the trim
            self.trims += heap.trim()
            trimmed = True

    def _gauges(self) -> None:
        running = self.work.running
        held = sum(run.batch.kv_bytes() for run in running)
        m = self.metrics
        m.set("kvevict_running_sequences", sum(len(run.rows) for run in running))
        m.set("kvevict_running_batches", len(running))
        m.set("kvevict_kv_bytes_held", held)
        reserved = self.admission.bound()
        # rows that left give the pools room for slack again; stored prefixes' pages are held
        self.pages.reserved = reserved + self.admission.stored()
        m.set("kvevict_kv_bytes_reserved", reserved)
        m.set("kvevict_kv_pool_bytes", self.pages.nbytes())
        m.set("kvevict_kv_bytes_full", sum(self.budgeter.stock_bytes(r.fed) for run in running for r in run.rows))
        m.peak("kvevict_kv_bytes_peak", held)
