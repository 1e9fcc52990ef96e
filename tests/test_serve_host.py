"""A server you can put on a host. API keys (401), a bounded wait queue (429), a per-request
deadline (504), clients that go away (their row and pages freed within one decode step, seen
through /metrics) and a drain that lets requests finish; over loopback with the openai client on
the tiny chat model (tests/tiny_chat_model.py). A ``Gate`` holds the worker wherever a test needs
requests waiting or in flight."""

import http.client
import json
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from kvevict.serve.auth import key_matches  # noqa: E402
from kvevict.serve.engine import Engine  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from serve_helpers import (  # noqa: E402,F401
    DEADLINE,
    DEFAULTS,
    MODEL,
    Gate,
    arrived,
    chat,
    events,
    folder,
    in_background,
    metric,
    open_stream,
    request,
    result,
    rows,
    wait_until,
)

KEY = "sk-kvevict-test-0123456789"
LONG = {"model": MODEL, "messages": chat("Talk for a long time."), "max_tokens": 100, "ignore_eos": True}


def _client(srv, key="t", timeout=DEADLINE):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def test_key_matches_only_a_bearer_token_equal_to_the_key():
    assert key_matches(f"Bearer {KEY}", KEY) and key_matches(f"bearer {KEY}", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer "):
        assert not key_matches(header, KEY), header


def test_api_key_401_on_every_v1_route_health_open_metrics_keyed_by_flag(folder):
    app, engine = build(folder, {**DEFAULTS, "api_key": KEY})
    with ServerThread(app) as srv:
        body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2}
        for method, path, data in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", body),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
            ("GET", "/v1/nothing-here", None),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                status, hdrs, text = request(srv.url, method, path, data, headers)
                err = json.loads(text)["error"]
                assert status == 401 and hdrs["www-authenticate"] == "Bearer", (path, headers)
                assert err["code"] == "invalid_api_key" and "--api-key" in err["message"]
        assert metric(srv.url, "kvevict_requests_total", outcome="unauthorized") == 12
        assert engine.metrics.get("kvevict_requests_total", outcome="completed") == 0  # nothing ran
        with pytest.raises(openai.AuthenticationError):
            _client(srv, key="not-it").chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
        r = _client(srv, key=KEY).chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
        assert r.usage.completion_tokens >= 1  # the openai client's api_key= is all a user sets
        assert [m.id for m in _client(srv, key=KEY).models.list().data] == [MODEL]
        assert request(srv.url, "GET", "/health")[0] == 200
        assert request(srv.url, "GET", "/metrics")[0] == 200  # open unless protect_metrics
    app, _ = build(folder, {**DEFAULTS, "api_key": KEY, "protect_metrics": True})
    with ServerThread(app) as srv:
        assert request(srv.url, "GET", "/metrics")[0] == 401
        status, _, text = request(srv.url, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and "kvevict_requests_total" in text
        assert request(srv.url, "GET", "/health")[0] == 200


def test_a_full_queue_answers_429_with_retry_after_and_the_queued_ones_complete(folder):
    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "max_queue": 1, "policy": "full"})
    with ServerThread(app) as srv, Gate(engine) as gate:
        client = _client(srv)
        kw = dict(model=MODEL, messages=LONG["messages"], max_tokens=60, extra_body={"ignore_eos": True})
        first = in_background(client.chat.completions.create, **kw)
        assert wait_until(lambda: arrived(engine) == 1)
        # the first decodes, held at a step: the only slot stays taken
        assert gate.run_until(lambda: engine.metrics.get("kvevict_running_sequences") == 1)
        assert metric(srv.url, "kvevict_running_sequences") == 1
        second = in_background(client.chat.completions.create, **kw)
        assert wait_until(lambda: metric(srv.url, "kvevict_queued_requests") == 1)
        status, headers, text = request(srv.url, "POST", "/v1/chat/completions", {**LONG, "max_tokens": 5})
        assert status == 429 and headers["retry-after"] == "1"
        err = json.loads(text)["error"]
        assert err["code"] == "queue_full" and "--max-queue 1" in err["message"]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=chat("me too"), max_tokens=5)
        assert metric(srv.url, "kvevict_requests_total", outcome="overloaded") == 2
        gate.open()
        assert result(*first).usage.completion_tokens == result(*second).usage.completion_tokens == 60  # none lost
        r = client.chat.completions.create(model=MODEL, messages=chat("room now?"), max_tokens=3)
        assert r.usage.completion_tokens >= 1


def _past_deadline(handle) -> bool:
    return time.monotonic() > handle.deadline


def test_request_timeout_ends_running_and_queued_requests_with_504_and_frees_them(folder):
    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "request_timeout": 0.6})
    with ServerThread(app) as srv, Gate(engine) as gate:
        # the worker is held at the first request's prefill while the second waits for the only
        # slot, until both deadlines have passed: one then times out decoding, the other waiting
        running = in_background(request, srv.url, "POST", "/v1/chat/completions", LONG)
        assert gate.wait_held()
        queued = in_background(request, srv.url, "POST", "/v1/chat/completions", LONG)
        assert wait_until(lambda: len(engine.admission.pending) == 1)
        assert wait_until(lambda: _past_deadline(engine.admission.pending[0]))  # the later of the two
        gate.open()
        for status, headers, text in (result(*running), result(*queued)):
            err = json.loads(text)["error"]
            assert status == 504 and err["type"] == "timeout" and "--request-timeout of 0.6 s" in err["message"]
            assert headers["x-should-retry"] == "false"  # the openai client would otherwise retry it twice
        # one timed out decoding, the other while it waited for the only slot
        outs = [e for e in events(engine) if e["event"] == "timeout" or e.get("reason") == "timeout"]
        assert len(outs) == 2 and {e["event"] for e in outs} == {"timeout", "finish"}
        # streamed: an error event with the status as its code, then [DONE]
        gate.close()
        streamed = in_background(request, srv.url, "POST", "/v1/chat/completions", {**LONG, "stream": True})
        assert gate.wait_held()  # at its prefill, its deadline counted from its arrival (the admit event's)
        admit = events(engine, "admit")[-1]
        assert wait_until(lambda: time.monotonic() > admit["t"] - admit["waited"] + 0.6)
        gate.open()
        status, _, text = result(*streamed)
        stream = [e[6:] for e in text.split("\n\n") if e]
        assert status == 200 and stream[-1] == "[DONE]" and json.loads(stream[-2])["error"]["code"] == 504
        assert metric(srv.url, "kvevict_requests_total", outcome="timeout") == 3
        assert wait_until(lambda: metric(srv.url, "kvevict_running_sequences") == 0)
        # the gauges drop with the batch; its pages go back when the worker lets go of it: waited for
        assert wait_until(lambda: metric(srv.url, "kvevict_kv_bytes_held") == 0 and engine.pages.pages_in_use() == 0)


def test_a_client_that_goes_away_frees_its_row_and_pages_within_one_decode_step(folder):
    """Streamed and not: the worker drops the row at its next step (the log counts the worker loops
    between the cancel and the drop), and /metrics shows the running rows and K/V bytes fall back
    to the one that stays."""
    app, engine = build(folder, {**DEFAULTS, "max_batch": 4})  # h2o rows: pages of the pool
    with ServerThread(app) as srv, Gate(engine) as gate:
        stayer = in_background(
            _client(srv).chat.completions.create,
            model=MODEL,
            messages=chat("I stay."),
            max_tokens=300,
            extra_body={"ignore_eos": True},
        )
        assert wait_until(lambda: arrived(engine) == 1)
        running = lambda n: lambda: engine.metrics.get("kvevict_running_sequences") == n  # noqa: E731
        assert gate.run_until(running(1))  # the stayer decodes, held at a step
        alone = metric(srv.url, "kvevict_kv_bytes_held")
        for streamed in (True, False):
            before = arrived(engine)
            if streamed:
                conn, _ = open_stream(srv.url, LONG)
            else:
                host, port = srv.url.removeprefix("http://").split(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
                conn.request("POST", "/v1/chat/completions", json.dumps(LONG), {"Content-Type": "application/json"})
            assert wait_until(lambda: arrived(engine) == before + 1)
            leaver = engine.admission.pending[-1].req.id
            assert gate.run_until(running(2))  # both decode, held at a step
            assert metric(srv.url, "kvevict_kv_bytes_held") > alone
            both = engine.pages.pages_in_use()
            handle = rows(engine)[leaver].handle
            conn.sock.close()  # the client goes away
            conn.close()
            assert wait_until(handle.cancelled.is_set)  # seen by the server while the worker is held
            assert gate.run_until(running(1))
            gone = [e for e in events(engine, "finish") if e["id"] == leaver][-1]
            assert gone["reason"] == "cancelled" and gone["generated"] < 300
            assert gone["loops_after_cancel"] <= 1, gone  # dropped at the worker's next step
            # at a budget of 8 tokens a row's storage stops growing at its first page: what is held
            # now is exactly what the stayer held alone, and half the pages
            assert metric(srv.url, "kvevict_kv_bytes_held") == alone
            assert 0 < 2 * engine.pages.pages_in_use() == both
        assert metric(srv.url, "kvevict_requests_total", outcome="cancelled") == 2
        gate.open()
        assert result(*stayer).usage.completion_tokens == 300
        assert wait_until(lambda: metric(srv.url, "kvevict_kv_bytes_held") == 0 and engine.pages.pages_in_use() == 0)


def test_the_idle_worker_gives_the_freed_heap_back_once_per_idle_spell(folder, monkeypatch):
    """Each time nothing runs or waits any more, the worker returns the heap's free pages to the OS
    (glibc's malloc_trim, ``kvevict.serve.heap``) once, not at every idle wake-up."""
    import platform

    from kvevict.serve import heap

    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(time.monotonic()) or True)
    app, engine = build(folder, DEFAULTS)
    with ServerThread(app) as srv:
        assert wait_until(lambda: engine.trims == 1)  # idle from the start
        for n in (2, 3):
            out = _client(srv).chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=3)
            assert out.choices[0].message.content is not None
            assert wait_until(lambda: engine.trims == n)  # after the request, idle again: one more
            time.sleep(1.2)  # the worker wakes every 0.5 s while idle: no trim for those
            assert len(calls) == n and engine.trims == n
    monkeypatch.undo()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert heap.trim()  # the real one, where there is a glibc: it ran


def test_the_trim_runs_outside_the_engines_lock(folder, monkeypatch):
    """A request that arrives while the idle worker trims the heap is not held up by the trim: the
    engine's lock is free while it runs."""
    from kvevict.serve import heap

    free, built, box = [], threading.Event(), {}

    def trim():  # the worker trims as soon as it starts, maybe before build() returns the engine
        assert built.wait(DEADLINE)
        lock = box["engine"].work.cond

        def take():  # a lock held by the trimming worker would never come free: no deadlock, a False
            if lock.acquire(timeout=DEADLINE / 10):
                lock.release()
                got.append(True)

        got: list[bool] = []
        t = threading.Thread(target=take)
        t.start()
        t.join()
        free.append(bool(got))  # another thread took the lock (and gave it back) during the trim
        return True

    monkeypatch.setattr(heap, "trim", trim)
    app, box["engine"] = build(folder, DEFAULTS)
    built.set()
    with ServerThread(app):
        assert wait_until(lambda: len(free) == 1)
    assert free == [True]


def _three_in_flight(folder, max_tokens):
    """A draining server with one batch slot and three requests of ``max_tokens`` in flight, the
    worker held at the first one's prefill with the other two waiting: (server, its thread, url,
    engine, the gate, the requests' (thread, box))."""
    from kvevict.serve.drain import DrainingServer

    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "policy": "full"})
    gate = Gate(engine)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=_port(), log_level="warning"), engine, DEADLINE)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    url = f"http://127.0.0.1:{server.config.port}"
    client = _client(type("S", (), {"url": url}))
    kw = dict(model=MODEL, messages=chat("finish me"), max_tokens=max_tokens, extra_body={"ignore_eos": True})
    flights = [in_background(client.chat.completions.create, **kw) for _ in range(3)]
    assert wait_until(lambda: arrived(engine) == 3) and gate.wait_held()
    assert metric(url, "kvevict_queued_requests") == 2
    return server, thread, url, engine, gate, flights


def test_drain_refuses_new_requests_503_finishes_those_in_flight_then_stops(folder):
    """In a thread (the signal itself is tested through the CLI in test_serve_cli.py): the drain is
    what SIGTERM starts."""
    server, thread, url, engine, gate, flights = _three_in_flight(folder, 40)
    server.handle_exit(signal.SIGTERM, None)
    assert wait_until(lambda: engine.draining)
    status, headers, text = request(url, "POST", "/v1/chat/completions", {**LONG, "max_tokens": 3})
    assert status == 503 and "shutting down" in json.loads(text)["error"]["message"] and "retry-after" in headers
    assert request(url, "GET", "/health")[0] == 503
    gate.open()
    for flight in flights:
        assert result(*flight).usage.completion_tokens == 40  # running and queued alike finished
    thread.join(DEADLINE)
    assert not thread.is_alive() and not engine.alive


def test_drain_waits_for_the_last_request_while_it_prefills(folder, monkeypatch):
    """Admitted and still prefilling, a request neither waits nor runs: the drain must not take the
    engine for idle then and stop it under that request (it ended with 503 "shutting down")."""
    looks = []  # what the drain saw each time it asked whether the engine is idle
    idle = Engine.idle
    monkeypatch.setattr(Engine, "idle", property(lambda engine: looks.append(idle.fget(engine)) or looks[-1]))
    server, thread, _, engine, gate, flights = _three_in_flight(folder, 6)
    prefills = lambda: len(events(engine, "admit")) == 3  # noqa: E731
    assert gate.run_until(prefills)  # the last request is admitted: held at its prefill
    assert not engine.admission.pending and rows(engine) == {}  # it neither waits nor runs
    server.handle_exit(signal.SIGTERM, None)
    assert wait_until(lambda: len(looks) >= 3)  # the drain looked, more than once, while it prefilled
    assert not any(looks) and engine.alive
    gate.open()
    for flight in flights:
        assert result(*flight).usage.completion_tokens == 6
    thread.join(DEADLINE)
    assert not thread.is_alive() and not engine.alive and looks[-1]


def test_drain_deadline_ends_what_is_still_running(folder):
    from kvevict.serve.drain import DrainingServer

    app, engine = build(folder, {**DEFAULTS, "policy": "full"})
    gate = Gate(engine)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=_port(), log_level="warning"), engine, 0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    url = f"http://127.0.0.1:{server.config.port}"
    flight = in_background(request, url, "POST", "/v1/chat/completions", LONG)
    assert gate.run_until(lambda: engine.metrics.get("kvevict_running_sequences") == 1)  # held mid-decode
    server.handle_exit(signal.SIGTERM, None)
    assert wait_until(lambda: engine.work.stopping)  # the drain's 0.5 s passed with the request still running
    gate.open()
    status, _, text = result(*flight)
    assert status == 503 and "shutting down" in text
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert not [e for e in events(engine, "finish") if e["reason"] == "length"]  # it never ran to its end


def _port():
    from kvevict.serve.server import free_port

    return free_port()
