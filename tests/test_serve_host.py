"""Issue 44: a server you can put on a host. API keys (401), a bounded wait queue (429), a
per-request deadline (504), clients that go away (their row and pages freed within one decode
step, seen through /metrics) and a drain that lets requests finish; over loopback with the openai
client on the tiny chat model (tests/tiny_chat_model.py)."""

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
from kvevict.serve.server import ServerThread, build  # noqa: E402
from test_serve import DEFAULTS, MODEL, _wait, chat, folder, metric, open_stream  # noqa: E402,F401

KEY = "sk-kvevict-test-0123456789"
LONG = {"model": MODEL, "messages": chat("Talk for a long time."), "max_tokens": 400, "ignore_eos": True}


def _client(srv, key="t", timeout=60):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def _slow(engine, seconds=0.01):
    """Every model call of the server's worker takes at least ``seconds``: requests stay in flight
    long enough to be cancelled, timed out or drained, whatever this machine's speed."""
    engine.model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def _request(url, method, path, body=None, headers=None):
    """(status, headers, body) of one plain HTTP request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read().decode()
    conn.close()
    return out


def _in_background(fn, *args, **kwargs):
    box = {}

    def run():
        try:
            box["r"] = fn(*args, **kwargs)
        except Exception as err:  # the test reads it
            box["err"] = err

    t = threading.Thread(target=run)
    t.start()
    return t, box


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
                status, hdrs, text = _request(srv.url, method, path, data, headers)
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
        assert _request(srv.url, "GET", "/health")[0] == 200
        assert _request(srv.url, "GET", "/metrics")[0] == 200  # open unless protect_metrics
    app, _ = build(folder, {**DEFAULTS, "api_key": KEY, "protect_metrics": True})
    with ServerThread(app) as srv:
        assert _request(srv.url, "GET", "/metrics")[0] == 401
        status, _, text = _request(srv.url, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and "kvevict_requests_total" in text
        assert _request(srv.url, "GET", "/health")[0] == 200


def test_a_full_queue_answers_429_with_retry_after_and_the_queued_ones_complete(folder):
    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "max_queue": 1, "policy": "full"})
    _slow(engine)
    with ServerThread(app) as srv:
        client = _client(srv)
        kw = dict(model=MODEL, messages=LONG["messages"], max_tokens=60, extra_body={"ignore_eos": True})
        t1, first = _in_background(client.chat.completions.create, **kw)
        assert _wait(lambda: metric(srv.url, "kvevict_running_sequences") == 1)
        t2, second = _in_background(client.chat.completions.create, **kw)
        assert _wait(lambda: metric(srv.url, "kvevict_queued_requests") == 1)
        status, headers, text = _request(srv.url, "POST", "/v1/chat/completions", {**LONG, "max_tokens": 5})
        assert status == 429 and headers["retry-after"] == "1"
        err = json.loads(text)["error"]
        assert err["code"] == "queue_full" and "--max-queue 1" in err["message"]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=chat("me too"), max_tokens=5)
        assert metric(srv.url, "kvevict_requests_total", outcome="overloaded") == 2
        t1.join(60)
        t2.join(60)
        assert first["r"].usage.completion_tokens == second["r"].usage.completion_tokens == 60  # none lost
        r = client.chat.completions.create(model=MODEL, messages=chat("room now?"), max_tokens=3)
        assert r.usage.completion_tokens >= 1


def test_request_timeout_ends_running_and_queued_requests_with_504_and_frees_them(folder):
    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "request_timeout": 0.6})
    # steps of 0.3 s: the running row is dropped at a step boundary after its deadline, by then the
    # waiting one's deadline (submitted a moment later) has passed too, however busy this machine is
    _slow(engine, 0.3)
    with ServerThread(app) as srv:
        t, queued = _in_background(_request, srv.url, "POST", "/v1/chat/completions", LONG)
        status, headers, text = _request(srv.url, "POST", "/v1/chat/completions", LONG)
        t.join(60)
        for status, headers, text in ((status, headers, text), queued["r"]):
            err = json.loads(text)["error"]
            assert status == 504 and err["type"] == "timeout" and "--request-timeout of 0.6 s" in err["message"]
            assert headers["x-should-retry"] == "false"  # the openai client would otherwise retry it twice
        # one timed out decoding, the other while it waited for the only slot
        outs = [e for e in engine.log if e["event"] == "timeout" or e.get("reason") == "timeout"]
        assert len(outs) == 2 and {e["event"] for e in outs} == {"timeout", "finish"}
        # streamed: an error event with the status as its code, then [DONE]
        status, _, text = _request(srv.url, "POST", "/v1/chat/completions", {**LONG, "stream": True})
        events = [e[6:] for e in text.split("\n\n") if e]
        assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
        assert metric(srv.url, "kvevict_requests_total", outcome="timeout") == 3
        assert _wait(lambda: metric(srv.url, "kvevict_running_sequences") == 0)
        assert metric(srv.url, "kvevict_kv_bytes_held") == 0 and engine.pages.pages_in_use() == 0


def test_a_client_that_goes_away_frees_its_row_and_pages_within_one_decode_step(folder):
    """Streamed and not: the worker drops the row at its next step (the log counts the worker loops
    between the cancel and the drop), and /metrics shows the running rows and K/V bytes fall back
    to the one that stays."""
    app, engine = build(folder, {**DEFAULTS, "max_batch": 4})  # h2o rows: pages of the pool
    _slow(engine, 0.02)
    with ServerThread(app) as srv:
        t, stayer = _in_background(
            _client(srv).chat.completions.create,
            model=MODEL,
            messages=chat("I stay."),
            max_tokens=300,
            extra_body={"ignore_eos": True},
        )
        assert _wait(lambda: metric(srv.url, "kvevict_running_sequences") == 1)
        alone = metric(srv.url, "kvevict_kv_bytes_held")
        for streamed in (True, False):
            if streamed:
                conn, leaver = open_stream(srv.url, LONG)
            else:
                host, port = srv.url.removeprefix("http://").split(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request("POST", "/v1/chat/completions", json.dumps(LONG), {"Content-Type": "application/json"})
                assert _wait(lambda: metric(srv.url, "kvevict_running_sequences") == 2)
                leaver = [e for e in engine.log if e["event"] == "admit"][-1]["id"]
            assert metric(srv.url, "kvevict_kv_bytes_held") > alone
            both = engine.pages.pages_in_use()
            conn.sock.close()  # the client goes away
            conn.close()
            assert _wait(lambda: metric(srv.url, "kvevict_running_sequences") == 1, 5)
            gone = [e for e in engine.log if e["event"] == "finish" and e["id"] == leaver][-1]
            assert gone["reason"] == "cancelled" and gone["generated"] < 300
            assert gone["loops_after_cancel"] <= 1, gone  # dropped at the worker's next step
            # at a budget of 8 tokens a row's storage stops growing at its first page: what is held
            # now is exactly what the stayer held alone, and half the pages
            assert metric(srv.url, "kvevict_kv_bytes_held") == alone
            assert 0 < 2 * engine.pages.pages_in_use() == both
        assert metric(srv.url, "kvevict_requests_total", outcome="cancelled") == 2
        t.join(60)
        assert stayer["r"].usage.completion_tokens == 300
        assert _wait(lambda: metric(srv.url, "kvevict_kv_bytes_held") == 0)
        assert engine.pages.pages_in_use() == 0


def test_the_idle_worker_gives_the_freed_heap_back_once_per_idle_spell(folder, monkeypatch):
    """Each time nothing runs or waits any more, the worker returns the heap's free pages to the OS
    (glibc's malloc_trim, ``kvevict.serve.heap``) once, not at every idle wake-up."""
    import platform

    from kvevict.serve import heap

    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(time.monotonic()) or True)
    app, engine = build(folder, DEFAULTS)
    with ServerThread(app) as srv:
        assert _wait(lambda: len(calls) == 1)  # idle from the start
        for n in (2, 3):
            out = _client(srv).chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=3)
            assert out.choices[0].message.content is not None
            assert _wait(lambda: len(calls) == n)  # after the request, idle again: one more
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
        assert built.wait(10)
        lock = box["engine"]._cond

        def take():
            if lock.acquire(timeout=2):
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
        assert _wait(lambda: len(free) == 1)
    assert free == [True]


def _three_in_flight(folder, seconds, max_tokens):
    """A draining server with one batch slot, each model call at least ``seconds`` long, and three
    requests of ``max_tokens`` in flight (one runs, two wait): (server, its thread, url, engine,
    the requests' (thread, box))."""
    from kvevict.serve.drain import DrainingServer

    app, engine = build(folder, {**DEFAULTS, "max_batch": 1, "policy": "full"})
    _slow(engine, seconds)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=_port(), log_level="warning"), engine, 30)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert _wait(lambda: server.started)
    url = f"http://127.0.0.1:{server.config.port}"
    client = _client(type("S", (), {"url": url}))
    kw = dict(model=MODEL, messages=chat("finish me"), max_tokens=max_tokens, extra_body={"ignore_eos": True})
    flights = [_in_background(client.chat.completions.create, **kw) for _ in range(3)]
    assert _wait(lambda: metric(url, "kvevict_queued_requests") == 2)
    return server, thread, url, engine, flights


def test_drain_refuses_new_requests_503_finishes_those_in_flight_then_stops(folder):
    """In a thread (the signal itself is tested through the CLI in test_serve_cli.py): the drain is
    what SIGTERM starts."""
    server, thread, url, engine, flights = _three_in_flight(folder, 0.01, 40)
    server.handle_exit(signal.SIGTERM, None)
    assert _wait(lambda: engine.draining)
    status, headers, text = _request(url, "POST", "/v1/chat/completions", {**LONG, "max_tokens": 3})
    assert status == 503 and "shutting down" in json.loads(text)["error"]["message"] and "retry-after" in headers
    assert _request(url, "GET", "/health")[0] == 503
    for t, box in flights:
        t.join(60)
        assert box["r"].usage.completion_tokens == 40  # running and queued alike finished
    thread.join(30)
    assert not thread.is_alive() and not engine.alive


def test_drain_waits_for_the_last_request_while_it_prefills(folder):
    """Admitted and still prefilling, a request neither waits nor runs: the drain must not take the
    engine for idle then and stop it under that request (it ended with 503 "shutting down")."""
    # each prefill outlasts several of the drain's looks at the engine
    server, thread, _, engine, flights = _three_in_flight(folder, 0.2, 6)
    server.handle_exit(signal.SIGTERM, None)
    for t, box in flights:
        t.join(60)
        assert "r" in box, box  # the request's error, or nothing when it is still running
        assert box["r"].usage.completion_tokens == 6, box
    thread.join(30)
    assert not thread.is_alive() and not engine.alive


def test_drain_deadline_ends_what_is_still_running(folder):
    from kvevict.serve.drain import DrainingServer

    app, engine = build(folder, {**DEFAULTS, "policy": "full"})
    _slow(engine, 0.02)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=_port(), log_level="warning"), engine, 0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert _wait(lambda: server.started)
    url = f"http://127.0.0.1:{server.config.port}"
    t, box = _in_background(_request, url, "POST", "/v1/chat/completions", LONG)
    assert _wait(lambda: metric(url, "kvevict_running_sequences") == 1)
    started = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    t.join(60)
    thread.join(30)
    status, _, text = box["r"]
    assert status == 503 and "shutting down" in text
    assert time.monotonic() - started < 10 and not thread.is_alive()


def _port():
    from kvevict.serve.server import free_port

    return free_port()
