"""Exclusive wall-clock timers wrapped around named functions for the length of a ``with`` block
(the bench's own instrumentation: nothing in the library is edited, and everything is restored).

Nested wrapped calls are subtracted from their caller, so the labels partition the time spent
inside wrapped code; the rest of a decode step is the model's own work."""

from __future__ import annotations

import functools
import time
from collections import defaultdict


class ExclusiveTimers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.wrapped: list[str] = []
        self.missing: list[str] = []
        self._stack: list[float] = []
        self._undo: list = []

    def _timed(self, fn, label):
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            timers._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = timers._stack.pop()
                timers.seconds[label] += dt - inner
                timers.calls[label] += 1
                if timers._stack:
                    timers._stack[-1] += dt

        return timed

    def wrap(self, owner, attr: str, label: str, where: str | None = None) -> bool:
        """Time ``owner.attr`` (a module function or a class's own method) under ``label``."""
        name = where or f"{getattr(owner, '__name__', owner)}.{attr}"
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None or not callable(fn):
            self.missing.append(name)
            return False
        setattr(owner, attr, self._timed(fn, label))
        self._undo.append(lambda: setattr(owner, attr, fn))
        self.wrapped.append(name)
        return True

    def wrap_mapping(self, mapping: dict, key: str, label: str, where: str) -> bool:
        """Time the function stored under ``mapping[key]`` (e.g. transformers' attention registry)."""
        fn = mapping.get(key)
        if fn is None:
            self.missing.append(where)
            return False
        mapping[key] = self._timed(fn, label)
        self._undo.append(lambda: mapping.__setitem__(key, fn))
        self.wrapped.append(where)
        return True

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False
