"""The engine: a queue of requests, continuous batching, and one worker thread that runs every
model call and streams tokens back to each request's asyncio queue.

Each loop of the worker (1) admits waiting requests, oldest first, while their K/V bytes fit
``Settings.kv_memory`` and fewer than ``max_batch`` sequences run (``memory.Budgeter`` bounds the
bytes); admitted prompts of one policy and budget are prefilled together in one forward, each gives
its first token at once, and they join the running batch: one ``EvictingCache`` holds rows of any policies and budgets (each evicts by its
own), and full-cache rows share a batch of their own; (2) steps every running batch by one token.
A sequence that ends (EOS, max_tokens, stop string), whose client went away or whose deadline
(``request_timeout``) passed leaves its batch at the next step and its storage is freed, so a
waiting request can take its place. At most ``max_queue`` requests wait (429 past it); a draining
engine (SIGTERM, ``drain``) refuses new ones (503) and finishes those it has.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import torch

from ..attention import ATTN_NAME, register
from ..storage import Pools
from ..rows import shareable
from .batch import DecodeBatch
from .detokenize import TextStream
from .errors import BadRequest
from .logprobs import prompt_entries, token_entries
from .memory import Budgeter, spec_policy
from .metrics import Metrics
from .protocol import GenRequest
from .sampling import make_generator, pick_tokens
from .settings import Settings

PREFILL_TOKENS_PER_STEP = 2048  # prompt tokens prefilled between two decode steps (at least one prompt)


class Handle:
    """One request's side of the engine: its events arrive on ``queue`` in the request's event loop.

    Events: ("prompt", logprob entries) with echo + logprobs, ("delta", text, logprob entries of the
    tokens it holds), ("finish", finish_reason, usage), ("error", message, HTTP status).
    """

    def __init__(self, req: GenRequest, loop, reserve: int, timeout: float | None = None, loops=lambda: 0):
        self.req, self.loop, self.reserve = req, loop, reserve
        # what admission counts of this row in a shared batch (see Budgeter.batch_bytes)
        self.spec = (req.policy, req.budget_tokens, req.recent, len(req.prompt_ids) + req.max_tokens)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.deadline = None if timeout is None else self.submitted + timeout
        self._loops, self.cancel_loop = loops, None  # the worker loop it was cancelled in (the log's)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancel_loop = self._loops()
        self.cancelled.set()


class _Row:
    """A running sequence."""

    def __init__(self, handle: Handle, tokenizer):
        self.handle, self.req = handle, handle.req
        self.text = TextStream(tokenizer, handle.req.stop)
        self.generator = make_generator(handle.req.seed)
        self.generated = 0
        self.fed = len(handle.req.prompt_ids)  # real tokens the cache has been given
        self.pending = None  # the token sampled last, fed at the next step
        self.entries: list = []  # logprob entries of tokens whose text has not been sent yet


class _Running:
    """A decode batch and its rows, in cache row order."""

    def __init__(self, batch: DecodeBatch, rows: list[_Row]):
        self.batch, self.rows = batch, rows


class Engine:
    def __init__(self, model, tokenizer, settings: Settings, metrics: Metrics | None = None):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.metrics = metrics or Metrics()
        self.context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = _eos_ids(model, tokenizer)
        self.log: deque[dict] = deque(maxlen=10_000)  # admissions, joins, finishes: for inspection and tests
        self._pending: deque[Handle] = deque()
        self._running: list[_Running] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.draining = False  # SIGTERM: new requests get 503, those admitted or waiting finish
        self.loops = 0  # worker loops so far: how soon a cancelled row leaves is counted in them
        self._thread = threading.Thread(target=self._run, name="kvevict-engine", daemon=True)
        # one attention implementation for every policy, "full" included (exact with a DynamicCache)
        register()
        model.set_attn_implementation(ATTN_NAME)
        self.budgeter = Budgeter(model, settings.kv_bits)
        # every budgeted row's keys and values: its own pages of these pools (kvevict.storage.paged)
        self.pages = Pools(limit=settings.kv_memory)
        self._opened: set = set()  # keys of the page pools open (Budgeter.opening): their page 0 is idle bytes
        if settings.budget is None:
            settings.budget = self.default_budget()
        self.metrics.set("kvevict_kv_memory_bytes", settings.kv_memory)

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

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
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
            what = ("lower max_tokens or shorten the prompt" if req.policy == "full"
                    else "lower kv_budget")
            raise BadRequest(f"this request needs {need} bytes of K/V storage, more than the server's "
                             f"kv_memory of {self.settings.kv_memory} bytes; {what}.",
                             "max_tokens" if req.policy == "full" else "kv_budget")
        return need

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs (a drain is over)."""
        with self._cond:
            return not self._pending and not self._running

    def drain(self) -> None:
        """Refuse new requests from now on (503); those already here go on (``idle`` says when done)."""
        with self._cond:
            self.draining = True

    def submit(self, req: GenRequest, loop) -> Handle:
        handle = Handle(req, loop, self.reserve_bytes(req), self.settings.request_timeout, lambda: self.loops)
        with self._cond:
            if self.draining or self._stopping:
                raise BadRequest("the server is shutting down and takes no new requests; send this one to "
                                 "another replica, or retry once it is back.", status=503,
                                 type="service_unavailable", headers={"Retry-After": "5"}, outcome="draining")
            if len(self._pending) >= self.settings.max_queue:
                # 429 + Retry-After: clients (the openai one included) back off and retry; one second
                # is about a decode step's worth of rows leaving at the defaults
                raise BadRequest(f"the server is overloaded: {len(self._pending)} requests already wait for "
                                 f"memory (--max-queue {self.settings.max_queue}); retry after a moment.",
                                 status=429, type="rate_limit_error", code="queue_full",
                                 headers={"Retry-After": "1"}, outcome="overloaded")
            self._pending.append(handle)
            self.metrics.set("kvevict_queued_requests", len(self._pending))
            self._cond.notify_all()
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
                for group in self._groups(admitted):
                    self._start(group)
                self._step_all()
                self._gauges()
        for run in self._running:
            for r in run.rows:
                r.handle.push(("error", "the server is shutting down.", 503))
        self._running.clear()
        self._gauges()

    def _bound(self, extra: list[Handle] = ()) -> int:
        """The most bytes the running batches can hold, with each of ``extra`` joining the batch
        ``_start`` will put it in."""
        batches = [[r.handle.spec for r in run.rows] for run in self._running]
        for h in extra:
            for specs in batches:
                if _joins(specs, h.spec):
                    specs.append(h.spec)
                    break
            else:
                batches.append([h.spec])
        return sum(self.budgeter.batch_bytes(specs, paged=True) for specs in batches)

    def _admit(self) -> list[Handle] | None:
        """Waiting requests that fit now, oldest first (the oldest that does not fit blocks the rest,
        so nobody starves); None when the server stops."""
        s = self.settings
        with self._cond:
            while True:
                if self._stopping:
                    for h in self._pending:
                        h.push(("error", "the server is shutting down.", 503))
                    self._pending.clear()
                    return None
                now = time.monotonic()
                gone = [h for h in self._pending if h.cancelled.is_set() or h.expired(now)]
                for h in gone:
                    self._pending.remove(h)
                    timed_out = not h.cancelled.is_set()
                    if timed_out:
                        h.push(("error", self._timeout_message(), 504))
                    self.log.append({"event": "timeout" if timed_out else "cancelled", "id": h.req.id, "t": now,
                                     "queued": True})
                    self.metrics.add("kvevict_requests_total", outcome="timeout" if timed_out else "cancelled")
                if self._running or self._pending:
                    break
                self._cond.wait(0.5)
            taken, tokens, compacted = [], 0, False
            running = sum(len(run.rows) for run in self._running)
            while self._pending and running + len(taken) < s.max_batch and tokens < PREFILL_TOKENS_PER_STEP:
                need = self._need([*taken, self._pending[0]])
                if need + self.pages.idle_bytes() > s.kv_memory:
                    if compacted or need + self.pages.zero_bytes() > s.kv_memory:
                        break
                    # free pages of some pool stand in the way: every pool gives its free pages back
                    # (between steps, no view of the pages is live), then the request fits
                    self.pages.compact()  # a pool no row used is gone: only the running rows' stay open
                    self._opened = {key for run in self._running for r in run.rows
                                    for key in self.budgeter.opening(*_format(r.handle.spec))}
                    compacted = True
                    continue
                h = self._pending.popleft()
                taken.append(h)
                tokens += len(h.req.prompt_ids)
            self._opened.update(key for h in taken for key in self.budgeter.opening(*_format(h.spec)))
            self.pages.reserved = self._bound(taken)
            self.metrics.set("kvevict_queued_requests", len(self._pending))
            return taken

    def _need(self, extra: list[Handle]) -> int:
        """What admitting ``extra`` asks of kv_memory besides the pools' idle pages: the running and
        admitted rows' bound (``_bound``) and the page 0 of every pool the newcomers would open."""
        opening = {}
        for h in extra:
            for key, n in self.budgeter.opening(*_format(h.spec)).items():
                if key not in self._opened:
                    opening[key] = max(opening.get(key, 0), n)
        return self._bound(extra) + sum(opening.values())

    def _groups(self, handles: list[Handle]) -> list[list[Handle]]:
        """Admitted requests that are prefilled in one forward: the same policy, budget and recent
        window, in arrival order; prompts that enter every layer without evicting apart from longer
        ones (a short prompt's padding then takes no slot: it holds only its own pages), and an
        Ada-KV prompt only with prompts of its length (a pooled tier stores padding)."""
        groups: dict[tuple, list[Handle]] = {}
        for h in handles:
            p, budget, recent, _ = h.spec
            n = len(h.req.prompt_ids)
            pol = None if p == "full" else spec_policy(p, recent)
            key = (p,) if p == "full" else (p, budget, recent, self.budgeter.fits(pol, budget, n),
                                            n if getattr(pol, "adaptive", False) else None)
            key += (_scores_prompt(h.req),)  # those prefills keep every position's logits: apart
            groups.setdefault(key, []).append(h)
        return list(groups.values())

    def _start(self, handles: list[Handle]) -> None:
        """Prefill admitted requests of one group together, stream each one's first token, and join
        the first running batch that can take them (any policy and budget; full-cache rows among
        themselves)."""
        now = time.monotonic()
        running = sum(len(run.rows) for run in self._running)
        for i, h in enumerate(handles):  # running: the sequences decoding beside it once it starts
            self.log.append({"event": "admit", "id": h.req.id, "t": now, "waited": now - h.submitted,
                             "running": running + i, "prefill": len(handles)})
        rows = [_Row(h, self.tokenizer) for h in handles]
        req = handles[0].req
        scores = _scores_prompt(req)
        try:
            batch, logits = DecodeBatch.prefill_many(self.model, [h.req.prompt_ids for h in handles], req.policy,
                                                     req.budget_tokens, req.recent, self.settings.kv_bits,
                                                     self.pages, all_logits=scores)
            if scores:  # echo + logprobs: the prompt's own, from the prefill's logits at every position
                for i, h in enumerate(handles):
                    h.push(("prompt", prompt_entries(logits[i], h.req.prompt_ids, h.req.logprobs)))
                logits = logits[:, -1]
        except Exception as err:  # these requests fail alone; the running batches go on
            self._fail(rows, err)
            return
        for h in handles:
            self.metrics.observe("kvevict_time_to_first_token_seconds", time.monotonic() - h.submitted)
        ended = self._advance(rows, logits)
        if ended:  # some ended at their first token
            keep = [i for i in range(len(rows)) if i not in ended]
            if not keep:
                return
            batch.keep(keep)
            rows = [rows[i] for i in keep]
        spec = rows[0].handle.spec
        for run in self._running:
            if _joins([r.handle.spec for r in run.rows], spec) and run.batch.can_join(batch):
                run.batch.join(batch)
                run.rows += rows
                for r in rows:
                    self._log_join(r.req, run)
                return
        self._running.append(_Running(batch, rows))
        for r in rows:
            self._log_join(r.req, self._running[-1])

    def _log_join(self, req: GenRequest, run: _Running) -> None:
        self.log.append({"event": "join", "id": req.id, "size": len(run.rows), "batch": id(run),
                         "ids": [r.req.id for r in run.rows], "t": time.monotonic()})

    def _step_all(self) -> None:
        # a method, not a loop in _run: a loop variable there would keep the last batch that ended
        # (and its pages) alive while the worker waits idle for the next request
        for run in list(self._running):
            self._step(run)

    def _step(self, run: _Running) -> None:
        now = time.monotonic()
        gone = [i for i, r in enumerate(run.rows) if r.handle.cancelled.is_set() or r.handle.expired(now)]
        for i in gone:
            self._finish(run.rows[i], "cancelled" if run.rows[i].handle.cancelled.is_set() else "timeout")
        if gone:
            self._keep(run, [i for i in range(len(run.rows)) if i not in gone])
            if not run.rows:
                return
        try:
            logits = run.batch.step([r.pending for r in run.rows])
        except Exception as err:  # a failure ends this batch, never the server
            self._running.remove(run)
            self._fail(run.rows, err)
            return
        for r in run.rows:
            r.fed += 1
        ended = self._advance(run.rows, logits)
        if ended:
            self._keep(run, [i for i in range(len(run.rows)) if i not in ended])

    def _advance(self, rows: list[_Row], logits) -> set[int]:
        """Pick each row's next token (fed at the next step), stream its text; finish the rows that
        end and return their indices."""
        tokens = pick_tokens(logits, [(r.req.temperature, r.req.top_p, r.generator) for r in rows])
        self.metrics.add("kvevict_generated_tokens_total", len(rows))
        want = [i for i, r in enumerate(rows) if r.req.logprobs is not None]
        if want:  # from the logits the step already has: one log_softmax for the rows that ask
            index = torch.tensor(want, device=logits.device)
            for i, e in zip(want, token_entries(logits[index], [tokens[i] for i in want],
                                                [rows[i].req.logprobs for i in want])):
                rows[i].entries.append(e)
        ended = set()
        for i, (r, tok) in enumerate(zip(rows, tokens)):
            r.generated += 1
            r.pending = tok
            reason = None
            if tok in self.eos_ids and not r.req.ignore_eos:
                reason = "stop"  # the EOS token counts as generated but is not text
            else:
                delta = r.text.add(tok)
                if delta:
                    self._send(r, delta)
                if r.text.stopped:
                    reason = "stop"
                elif r.generated >= r.req.max_tokens:
                    reason = "length"
            if reason:
                self._finish(r, reason)
                ended.add(i)
        return ended

    def _send(self, r: _Row, text: str) -> None:
        """A text delta with the logprob entries of the tokens it completes."""
        r.handle.push(("delta", text, r.entries))
        r.entries = []

    def _keep(self, run: _Running, keep: list[int]) -> None:
        before, size = run.batch.kv_bytes(), len(run.rows)
        run.rows = [run.rows[i] for i in keep]
        if not run.rows:
            self._running.remove(run)  # the batch and its cache are dropped whole
            after = 0
        else:
            run.batch.keep(keep)
            after = run.batch.kv_bytes()
        self.log.append({"event": "shrink", "ids": [r.req.id for r in run.rows], "size_before": size,
                         "size": len(run.rows), "kv_bytes_before": before, "kv_bytes": after})
        with self._cond:  # memory was freed: the next admission sees it
            self._cond.notify_all()

    def _finish(self, r: _Row, reason: str) -> None:
        """A sequence ends: tell its client how, and what its cache held."""
        req, prompt = r.req, len(r.req.prompt_ids)
        entry = {"event": "finish", "id": req.id, "reason": reason, "generated": r.generated, "t": time.monotonic()}
        if r.handle.cancel_loop is not None:
            entry["loops_after_cancel"] = self.loops - r.handle.cancel_loop
        self.log.append(entry)
        self.metrics.add("kvevict_prompt_tokens_total", prompt)
        budget = req.budget_tokens
        evicted = 0 if budget is None else max(0, r.fed - budget)
        self.metrics.add("kvevict_evicted_tokens_total", evicted * self.budgeter.entries_per_token)
        if reason == "cancelled":
            self.metrics.add("kvevict_requests_total", outcome="cancelled")
            return
        if reason == "timeout":
            self.metrics.add("kvevict_requests_total", outcome="timeout")
            r.handle.push(("error", self._timeout_message(), 504))
            return
        tail = r.text.flush()
        if tail or r.entries:  # held-back text, and the logprobs of tokens with no text (EOS)
            self._send(r, tail)
        held = self.budgeter.row_bytes(req.policy, budget, req.recent, r.fed)
        usage = {"prompt_tokens": prompt, "completion_tokens": r.generated, "total_tokens": prompt + r.generated,
                 "kv_policy": req.policy, "kv_budget": req.budget, "kv_budget_tokens": budget,
                 "kv_bytes": held, "kv_bytes_full": self.budgeter.stock_bytes(r.fed), "kv_evicted_tokens": evicted}
        self.metrics.add("kvevict_requests_total", outcome="completed")
        r.handle.push(("finish", reason, usage))

    def _timeout_message(self) -> str:
        return (f"the request did not finish within the server's --request-timeout of "
                f"{self.settings.request_timeout:g} s; lower max_tokens, or retry when the server is less busy.")

    def _fail(self, rows: list[_Row], err: Exception) -> None:
        msg = f"generation failed: {type(err).__name__}: {err}"
        for r in rows:
            r.handle.push(("error", msg, 500))
        self.metrics.add("kvevict_requests_total", len(rows), outcome="failed")
        self.log.append({"event": "failed", "ids": [r.req.id for r in rows], "error": msg})

    def _gauges(self) -> None:
        held = sum(run.batch.kv_bytes() for run in self._running)
        m = self.metrics
        m.set("kvevict_running_sequences", sum(len(run.rows) for run in self._running))
        m.set("kvevict_running_batches", len(self._running))
        m.set("kvevict_kv_bytes_held", held)
        reserved = self._bound()
        self.pages.reserved = reserved  # rows that left give the pools room for slack again
        m.set("kvevict_kv_bytes_reserved", reserved)
        m.set("kvevict_kv_pool_bytes", self.pages.nbytes())
        m.set("kvevict_kv_bytes_full", sum(self.budgeter.stock_bytes(r.fed) for run in self._running for r in run.rows))
        m.peak("kvevict_kv_bytes_peak", held)


def _scores_prompt(req: GenRequest) -> bool:
    """Whether a request asks for its prompt's logprobs (echo with logprobs)."""
    return req.echo and req.logprobs is not None


def _format(spec: tuple) -> tuple:
    """(policy, recent, length) of a row's ``spec``: what decides the page pools it opens."""
    return spec[0], spec[2], spec[3]


def _joins(specs: list[tuple], spec: tuple) -> bool:
    """Whether a row of ``spec`` (policy, budget_tokens, recent, length) can join a batch of rows
    ``specs``: full-cache rows share a DynamicCache, budgeted rows of policies that can share one
    forward (``rows.shareable``) an EvictingCache (each row its own pages: a short chat does not
    take a long prompt's width)."""
    if not specs or (specs[0][0] == "full") != (spec[0] == "full"):
        return False
    if spec[0] == "full":
        return True
    return shareable([spec_policy(p, recent) for p, _, recent, _ in (*specs, spec)])


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(source, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
