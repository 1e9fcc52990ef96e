"""Running the app: uvicorn in the foreground (the CLI) or in a background thread (tests, scripts)."""

from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build(model_name: str, settings_kwargs: dict, threads: int | None = None):
    """Load the model and return (app, engine), the engine already started."""
    import torch

    from ..models import load_model
    from .app import create_app
    from .engine import Engine
    from .settings import Settings

    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model(model_name)
    settings = Settings(**settings_kwargs)
    engine = Engine(model, tok, settings).start()
    return create_app(engine), engine


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; a context manager that always stops it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 30.0):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvevict-uvicorn", daemon=True)
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
