"""A request's bookkeeping in the engine: its ``Handle`` (events to the client, cancel, deadline),
its ``Row`` once it decodes, the ``Running`` batch it sits in, and which batch a row may join."""

from __future__ import annotations

import asyncio
import threading
import time

from ..rows import shareable
from .batch import DecodeBatch
from .budgeter import spec_policy
from .detokenize import TextStream
from .protocol import GenRequest
from .sampling import make_generator


class Handle:
    """One request's side of the engine: its events arrive on ``queue`` in the request's event loop.

    Events: ("prompt", logprob entries) with echo + logprobs, ("delta", text, logprob entries of the
    tokens it holds), ("finish", finish_reason, usage), ("error", message, HTTP status).
    """

    def __init__(self, req: GenRequest, loop, reserve: int, timeout: float | None = None, loops=lambda: 0):
        self.req, self.loop, self.reserve = req, loop, reserve
        # what admission counts of this row in a shared batch (see Budgeter.batch_bytes)
        self.spec = (req.policy, req.budget_tokens, req.recent, len(req.prompt_ids) + req.max_tokens)
        self.stores = 0  # bytes admission reserves for a copy of its prompt's prefix in the prefix store
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.timeout = timeout
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

    def push_timeout(self) -> None:
        """Tell the client its deadline passed (504), waiting or decoding."""
        self.push(
            (
                "error",
                f"the request did not finish within the server's --request-timeout of "
                f"{self.timeout:g} s; lower max_tokens, or retry when the server is less busy.",
                504,
            )
        )


class Row:
    """A running sequence."""

    def __init__(self, handle: Handle, tokenizer):
        self.handle, self.req = handle, handle.req
        self.text = TextStream(tokenizer, handle.req.stop)
        self.generator = make_generator(handle.req.seed)
        self.generated = 0
        self.fed = len(handle.req.prompt_ids)  # real tokens the cache has been given
        self.pending = None  # the token sampled last, fed at the next step
        self.entries: list = []  # logprob entries of tokens whose text has not been sent yet


class Running:
    """A decode batch and its rows, in cache row order."""

    def __init__(self, batch: DecodeBatch, rows: list[Row]):
        self.batch, self.rows = batch, rows


def scores_prompt(req: GenRequest) -> bool:
    """Whether a request asks for its prompt's logprobs (echo with logprobs)."""
    return req.echo and req.logprobs is not None


def joins(specs: list[tuple], spec: tuple) -> bool:
    """Whether a row of ``spec`` (policy, budget_tokens, recent, length) can join a batch of rows
    ``specs``: full-cache rows share a DynamicCache, budgeted rows of policies that can share one
    forward (``rows.shareable``) an EvictingCache (each row its own pages: a short chat does not
    take a long prompt's width)."""
    if not specs or (specs[0][0] == "full") != (spec[0] == "full"):
        return False
    if spec[0] == "full":
        return True
    return shareable([spec_policy(p, recent) for p, _, recent, _ in (*specs, spec)])
