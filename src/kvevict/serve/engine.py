"""The engine: a queue of requests, a scheduler that groups them into batches, and one worker
thread that runs every model call and streams tokens back to each request's asyncio queue.

Requests that share a cache must share its policy and budget, so the scheduler takes the oldest
waiting request's group (policy, budget in tokens, recent window) and up to ``max_batch`` waiting
requests of that group, oldest first. A batch runs until its last sequence ends; a sequence that
ends (EOS, max_tokens, stop string) or whose client went away is dropped from the cache at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import torch

from ..attention import ATTN_NAME, register
from .batch import DecodeBatch
from .detokenize import TextStream
from .metrics import Metrics
from .protocol import GenRequest
from .sampling import make_generator, next_token
from .settings import Settings


class Handle:
    """One request's side of the engine: its events arrive on ``queue`` in the request's event loop.

    Events: ("delta", text), ("finish", finish_reason, usage), ("error", message).
    """

    def __init__(self, req: GenRequest, loop):
        self.req, self.loop = req, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class _Row:
    """A sequence in the running batch."""

    def __init__(self, handle: Handle, tokenizer):
        self.handle, self.req = handle, handle.req
        self.text = TextStream(tokenizer, handle.req.stop)
        self.generator = make_generator(handle.req.seed)
        self.generated = 0
        self.fed = len(handle.req.prompt_ids)  # real tokens the cache has been given


class Engine:
    def __init__(self, model, tokenizer, settings: Settings, metrics: Metrics | None = None):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.metrics = metrics or Metrics()
        self.context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(model, tokenizer)
        self.log: deque[dict] = deque(maxlen=10_000)  # batches and drops, for /metrics-like inspection and tests
        self._pending: list[Handle] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvevict-engine", daemon=True)
        # one attention implementation for every policy, "full" included (exact with a DynamicCache)
        register()
        model.set_attn_implementation(ATTN_NAME)

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

    def submit(self, req: GenRequest, loop) -> Handle:
        handle = Handle(req, loop)
        with self._cond:
            self._pending.append(handle)
            self.metrics.set("kvevict_queued_requests", len(self._pending))
            self._cond.notify_all()
        return handle

    # -- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            picked = self._next_batch()
            if picked is None:
                if self._stopping:
                    return
                continue
            group, handles = picked
            try:
                with torch.inference_mode():
                    self._decode(group, handles)
            except Exception as err:  # a failure ends this batch, never the server
                msg = f"generation failed: {type(err).__name__}: {err}"
                for h in handles:
                    h.push(("error", msg))
                self.metrics.add("kvevict_requests_total", len(handles), outcome="failed")
                self.log.append({"event": "failed", "ids": [h.req.id for h in handles], "error": msg})
            finally:
                self.metrics.set("kvevict_running_sequences", 0)
                self.metrics.set("kvevict_kv_bytes_held", 0)
                self.metrics.set("kvevict_kv_bytes_full", 0)

    def _next_batch(self):
        s = self.settings
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait(0.5)
            if self._stopping:
                for h in self._pending:
                    h.push(("error", "the server is shutting down."))
                self._pending.clear()
                return None
            deadline = time.monotonic() + s.batch_wait_s  # let concurrent arrivals join this batch
            while len(self._pending) < s.max_batch and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            gone = [h for h in self._pending if h.cancelled.is_set()]
            if gone:
                self.metrics.add("kvevict_requests_total", len(gone), outcome="cancelled")
            self._pending = [h for h in self._pending if not h.cancelled.is_set()]
            if not self._pending:
                return None
            group = self._pending[0].req.group
            take = [h for h in self._pending if h.req.group == group][: s.max_batch]
            self._pending = [h for h in self._pending if h not in take]
            self.metrics.set("kvevict_queued_requests", len(self._pending))
            return group, take

    def _decode(self, group, handles: list[Handle]) -> None:
        policy, budget_tokens, recent = group
        rows = [_Row(h, self.tokenizer) for h in handles]
        batch = DecodeBatch(self.model, [r.req.prompt_ids for r in rows], policy, budget_tokens, recent, self.pad_id)
        info = {"event": "batch", "policy": policy, "budget_tokens": budget_tokens, "size": len(rows),
                "ids": [r.req.id for r in rows], "peak_kv_bytes": 0}
        self.log.append(info)
        self.metrics.add("kvevict_batches_total")
        self.metrics.add("kvevict_batched_sequences_total", len(rows))
        logits = batch.prefill()
        token_bytes, entries = batch.token_bytes(), batch.num_kv_entries_per_token()
        while rows:
            held = batch.kv_bytes()
            info["peak_kv_bytes"] = max(info["peak_kv_bytes"], held)
            self.metrics.set("kvevict_running_sequences", len(rows))
            self.metrics.set("kvevict_kv_bytes_held", held)
            self.metrics.set("kvevict_kv_bytes_full", sum(r.fed for r in rows) * token_bytes)
            self.metrics.peak("kvevict_kv_bytes_peak", held)
            alive, tokens, ending = self._next_tokens(rows, logits)
            # counters first: a client that reads /metrics right after its answer sees its tokens
            self.metrics.add("kvevict_generated_tokens_total", len(rows) - sum(x == "cancelled" for _, x in ending))
            for r, reason in ending:
                self._drop(r, reason, held, len(rows), budget_tokens, token_bytes, entries)
            if not alive:
                break
            if len(alive) < len(rows):
                before = len(rows)
                batch.keep(alive)
                rows = [rows[i] for i in alive]
                self.log.append({"event": "shrink", "ids": [r.req.id for r in rows], "size_before": before,
                                 "size": len(rows), "kv_bytes_before": held, "kv_bytes": batch.kv_bytes()})
            logits = batch.step(tokens)
            for r in rows:
                r.fed += 1

    def _next_tokens(self, rows: list[_Row], logits):
        """Pick each sequence's next token and stream its text; -> (rows going on, their tokens,
        [(row, finish reason)] for the rows that end here)."""
        alive, tokens, ending = [], [], []
        for i, r in enumerate(rows):
            if r.handle.cancelled.is_set():
                ending.append((r, "cancelled"))
                continue
            tok = next_token(logits[i], r.req.temperature, r.req.top_p, r.generator)
            r.generated += 1
            reason = None
            if tok in self.eos_ids and not r.req.ignore_eos:
                reason = "stop"  # the EOS token counts as generated but is not text
            else:
                delta = r.text.add(tok)
                if delta:
                    r.handle.push(("delta", delta))
                if r.text.stopped:
                    reason = "stop"
                elif r.generated >= r.req.max_tokens:
                    reason = "length"
            if reason:
                ending.append((r, reason))
            else:
                alive.append(i)
                tokens.append(tok)
        return alive, tokens, ending

    def _drop(self, r: _Row, reason: str, held: int, size: int, budget_tokens, token_bytes: int, entries: int):
        """A sequence leaves the batch: tell its client how it ended and what its cache held."""
        evicted = 0 if budget_tokens is None else max(0, r.fed - budget_tokens)
        self.metrics.add("kvevict_evicted_tokens_total", evicted * entries)
        self.metrics.add("kvevict_prompt_tokens_total", len(r.req.prompt_ids))
        self.log.append({"event": "drop", "id": r.req.id, "reason": reason, "batch_size": size,
                         "generated": r.generated})
        if reason == "cancelled":
            self.metrics.add("kvevict_requests_total", outcome="cancelled")
            return
        tail = r.text.flush()
        if tail:
            r.handle.push(("delta", tail))
        prompt = len(r.req.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": r.generated, "total_tokens": prompt + r.generated,
                 "kv_policy": r.req.policy, "kv_budget": r.req.budget, "kv_budget_tokens": budget_tokens,
                 "kv_bytes": held // size, "kv_bytes_full": r.fed * token_bytes, "kv_evicted_tokens": evicted}
        self.metrics.add("kvevict_requests_total", outcome="completed")
        r.handle.push(("finish", reason, usage))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(source, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
