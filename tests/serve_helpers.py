"""What the server tests share: the tiny chat model's server defaults, strict reads of /metrics,
plain HTTP, waits on a condition with a generous deadline, and a ``Gate`` that holds the engine's
worker at a model call, so that a request stays queued or in flight for exactly as long as a test
needs, however fast or busy the machine is."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

import kvevict
from conftest import DEADLINE
from kvevict.storage import stat_bytes
from tiny_chat_model import save_tiny_chat_model

MODEL = "tiny"
# kv_bits=None: rows in the model's dtype, compared with the library's cache (tests/test_serve_storage.py
# covers the packed default)
DEFAULTS = dict(model_id=MODEL, policy="h2o", budget=8, max_tokens=16, max_tokens_limit=480, max_batch=8, kv_bits=None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def reference(folder):
    """A second copy of the model for answers computed alone (the server's copy is its worker's)."""
    return kvevict.load_model(folder)


def alone(policy: str) -> str:
    """The cache a request's answer alone is computed with: the server evicts one token a step."""
    return policy if policy == "full" else f"{policy}+slack=1"


def chat(text):
    return [{"role": "user", "content": text}]


def token_bytes(model):
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * c.num_key_value_heads * 2 * head_dim * 4  # K and V, fp32


def held_bytes(model, slots: int, policy: str) -> int:
    """What an evicting cache holds for one sequence of ``slots`` kept tokens: K and V, plus per slot
    its position (2 bytes) and the policy's statistics (``stat_bytes``), plus a count per layer."""
    c = model.config
    stats = stat_bytes(kvevict.POLICIES[policy].stats)
    per_slot = token_bytes(model) + c.num_hidden_layers * c.num_key_value_heads * (2 + stats)
    return slots * per_slot + 8 * c.num_hidden_layers


def request(url, method, path, body=None, headers=None):
    """(status, headers, text) of one plain HTTP request, for what the openai client hides; ``body``
    is JSON-encoded unless it is a string already."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
    data = body if body is None or isinstance(body, str) else json.dumps(body)
    sent = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, data, {**sent, **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read().decode()
    conn.close()
    return out


def get(url, path):
    status, _, text = request(url, "GET", path)
    return status, text


def post(url, path, body):
    status, _, text = request(url, "POST", path, body)
    return status, text


def metric(url, name, **labels) -> float:
    """One series of /metrics; a missing series fails (a renamed metric must not read as 0)."""
    text = get(url, "/metrics")[1]
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    want = f"{name}{{{lab}}}" if lab else name
    for line in text.splitlines():
        if line.split(" ")[0] == want:
            return float(line.split(" ")[1])
    raise AssertionError(f"/metrics has no series {want}")


def wait_until(cond, timeout: float = DEADLINE) -> bool:
    """Whether ``cond()`` held within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def in_background(fn, *args, **kwargs):
    """``fn`` in a thread: (the thread, a box that gets "r", its result, or "err", what it raised)."""
    box = {}

    def run():
        try:
            box["r"] = fn(*args, **kwargs)
        except Exception as err:  # the test reads it
            box["err"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def result(thread, box):
    """What a background call returned, once it has; what it raised is raised here."""
    thread.join(DEADLINE)
    assert not thread.is_alive(), "the request did not end"
    if "err" in box:
        raise box["err"]
    return box["r"]


def open_stream(url, body):
    """A streamed chat request, read up to its first event (the role, sent at once, queued or not):
    returns (the connection, its request id)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    while not (line := resp.readline().decode()).startswith("data: "):
        assert line, "the stream ended before its first event"
    return conn, json.loads(line[6:])["id"].removeprefix("chatcmpl-")


def events(engine, kind=None) -> list[dict]:
    """The engine's log (a copy: the worker may be appending), of one kind of event or all."""
    return [e for e in list(engine.log) if kind is None or e["event"] == kind]


def arrived(engine) -> int:
    """Requests the engine has taken into its queue so far (waiting, admitted or ended since)."""
    return engine.received


def rows(engine) -> dict:
    """The running rows by request id: their handles and tokens generated (read while the worker
    is held at the gate, when nothing changes them)."""
    return {r.req.id: r for run in list(engine.work.running) for r in run.rows}


class Gate:
    """Holds the engine's worker at its model calls (a forward pre-hook on its model).

    Closed, each model call waits until the gate opens; ``run_until(pred)`` lets the worker go on
    until ``pred()`` holds when it comes to a model call, then holds it there. Between two model
    calls the worker admits, drops and ends rows and sets the gauges, so a test sees one settled
    state while the worker is held. A test that fails without opening the gate does not hang: a
    held call goes on after ``DEADLINE``."""

    def __init__(self, engine, closed: bool = True):
        self._cond = threading.Condition()
        self._closed, self._until = closed, None
        self.held = False  # the worker waits at a model call now
        self._hook = engine.model.register_forward_pre_hook(self._call)

    def _call(self, module, args) -> None:
        with self._cond:
            if self._until is not None and self._until():
                self._closed, self._until = True, None
            if not self._closed:
                return
            self.held = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._closed, DEADLINE)
            self.held = False

    def close(self) -> None:
        """Hold the worker at its next model call."""
        with self._cond:
            self._closed, self._until = True, None

    def open(self) -> None:
        with self._cond:
            self._closed, self._until = False, None
            self._cond.notify_all()

    def wait_held(self, timeout: float = DEADLINE) -> bool:
        """Whether the worker came to a model call of a closed gate within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held and self._closed, timeout)

    def run_until(self, pred, timeout: float = DEADLINE) -> bool:
        """Let the worker go on until ``pred()`` holds at a model call, and hold it there. Whether it
        is held so within ``timeout`` (the worker only comes to a model call while it has work)."""
        with self._cond:
            if pred():
                self._closed, self._until = True, None
            else:
                self._closed, self._until = False, pred
                self._cond.notify_all()
            return self._cond.wait_for(lambda: self.held and self._closed, timeout)

    def remove(self) -> None:
        self._hook.remove()
        self.open()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
