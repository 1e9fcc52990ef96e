"""The engine's work state: who waits, who is starting, who runs, and whether the engine drains or
stops. The event loop's side (``Engine.submit``, ``drain``, ``stop``) and the worker thread share
it under one lock, ``cond``, which the worker also waits on for work."""

from __future__ import annotations

import threading
from collections import deque

from .handle import Handle, Running


class Work:
    def __init__(self, pending: deque[Handle], running: list[Running]):
        self.cond = threading.Condition()
        self.pending = pending  # waiting requests, oldest first (``Admission.pending``, the same deque)
        self.running = running  # the running batches (the same list the admission and decoder see)
        self.starting = 0  # admitted requests still prefilling: neither waiting nor running, not idle
        self.stopping = False
        self.draining = False  # SIGTERM: new requests get 503, those admitted or waiting finish

    @property
    def idle(self) -> bool:
        """Nothing waits, nothing starts and nothing runs."""
        with self.cond:
            return not self.pending and not self.running and not self.starting

    def drain(self) -> None:
        with self.cond:
            self.draining = True

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def notify(self) -> None:
        """Wake the worker: memory was freed, or work came."""
        with self.cond:
            self.cond.notify_all()
