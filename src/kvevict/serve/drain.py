"""A graceful stop for ``kvevict serve``: on SIGTERM (or a first Ctrl-C) the server keeps its port
open but answers new requests 503 and /health 503 ("draining", so a load balancer takes it out of
rotation), lets the requests it has finish for up to ``drain_timeout`` seconds, ends any still
running with an error, then exits with status 0. A second Ctrl-C exits at once.

uvicorn alone stops listening at the first signal (new clients see a refused connection, not a
503), and re-raises the signal after its shutdown, so the process ends by SIGTERM (status -15)."""

from __future__ import annotations

import signal
import sys
import threading
import time

import uvicorn

GRACE_S = 5.0  # after the engine is idle: for the last responses to be written before uvicorn cuts them


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # not recorded in _captured_signals: uvicorn would raise it again once stopped
        if self._drainer is None:
            self._drainer = threading.Thread(target=self._drain, name="kvevict-drain", daemon=True)
            self._drainer.start()
        elif sig == signal.SIGINT:  # asked twice: stop now
            self.force_exit = self.should_exit = True

    def _drain(self) -> None:
        try:
            self.engine.drain()
            _say(f"kvevict: draining, up to {self.drain_timeout:g} s for the requests in flight")
            deadline = time.monotonic() + self.drain_timeout
            while not self.engine.idle and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self.engine.idle:  # past the deadline: the rest end with "shutting down" (503)
                _say("kvevict: drain deadline passed, ending the requests still running")
            self.engine.stop()
        finally:  # whatever happened above, the process must still stop
            self.should_exit = True


def _say(line: str) -> None:
    """A line on stderr, which may be a pipe whose reader is gone (a supervisor that died): the
    drain must not end there (it did: a BrokenPipeError killed the drain thread and the server
    never exited)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def serve(app, engine, host: str, port: int, drain_timeout: float) -> None:
    """uvicorn in the foreground, draining on SIGTERM; returns once the drain is over."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S)
    DrainingServer(config, engine, drain_timeout).run()
