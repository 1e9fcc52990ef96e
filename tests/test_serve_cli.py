"""``kvevict serve`` as a user starts it: a subprocess on loopback, always stopped."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from kvevict.serve.server import free_port  # noqa: E402
from serve_helpers import DEADLINE, get, metric, wait_until  # noqa: E402
from tiny_chat_model import save_tiny_chat_model  # noqa: E402

GATED = str(Path(__file__).with_name("gated_cli.py"))


def _start(folder, port, *flags, gate=None):
    """``kvevict serve`` on the tiny model, returned once /health answers; with ``gate`` (a path)
    its model calls wait whenever that file exists (tests/gated_cli.py)."""
    command = [sys.executable, GATED, str(gate)] if gate else [sys.executable, "-m", "kvevict.cli"]
    proc = subprocess.Popen(
        [*command, "serve", "--model", str(folder), "--port", str(port), "--served-name", "tiny", "--threads", "1"]
        + list(flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + DEADLINE
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=DEADLINE):
                return proc
        except OSError:
            assert time.monotonic() < deadline, f"server did not come up in {DEADLINE:g} s"
            time.sleep(0.25)


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(DEADLINE)


def test_kvevict_serve_starts_answers_and_stops(tmp_path):
    folder = save_tiny_chat_model(tmp_path / "tiny")
    port = free_port()
    proc = _start(folder, port, "--policy", "recency", "--budget", "12")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=DEADLINE) as r:
            assert json.load(r)["status"] == "ok"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="t", max_retries=0, timeout=DEADLINE)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=6
        )
        assert r.usage.kv_policy == "recency" and r.usage.kv_budget_tokens == 12  # the CLI's defaults
    finally:
        _stop(proc)


def test_sigterm_drains_503_for_new_requests_in_flight_ones_finish_exit_0(tmp_path):
    """SIGTERM to a real ``kvevict serve`` process with one request decoding and seven waiting
    (--max-batch 1): a request sent after it gets 503, all eight finish whole, and the process
    exits with status 0. The process's worker is held (tests/gated_cli.py) until the seven wait
    and the drain has begun, then let go."""
    import asyncio
    import signal

    folder = save_tiny_chat_model(tmp_path / "tiny")
    port, gate = free_port(), tmp_path / "gate"
    url = f"http://127.0.0.1:{port}"
    drain = ("--drain-timeout", str(DEADLINE))
    proc = _start(folder, port, "--policy", "full", "--max-batch", "1", *drain, "--api-key", "k", gate=gate)
    gate.touch()  # up, idle: from now on its model calls wait
    try:
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )

        async def main():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=DEADLINE) as ac:

                async def streamed():
                    return [c async for c in await ac.chat.completions.create(**kw, stream=True)]

                first = asyncio.create_task(streamed())
                rest = [asyncio.create_task(ac.chat.completions.create(**kw)) for _ in range(7)]
                held = gate.with_name("gate.held")
                queued = lambda: held.exists() and metric(url, "kvevict_queued_requests") == 7  # noqa: E731
                assert await asyncio.to_thread(wait_until, queued)  # one held at its prefill, seven waiting
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(wait_until, lambda: get(url, "/health")[0] == 503)  # draining
                with pytest.raises(openai.InternalServerError) as refused:  # 503
                    await ac.with_options(max_retries=0).chat.completions.create(**{**kw, "max_tokens": 2})
                gate.unlink()
                return refused.value, await first, await asyncio.gather(*rest)

        refused, streamed, rest = asyncio.run(main())
        assert refused.status_code == 503 and "shutting down" in str(refused)
        assert streamed[-1].choices[0].finish_reason == "length"
        assert [r.usage.completion_tokens for r in rest] == [40] * 7
        assert proc.wait(DEADLINE) == 0
        assert "draining" in proc.stdout.read()
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--request-timeout", "0"], "--request-timeout must be a positive number of seconds"),
        (["--protect-metrics"], "--protect-metrics keys /metrics with the API key"),
        (["--api-key", " "], "--api-key / KVEVICT_API_KEY must be a non-empty key"),
        (["--budget", "0"], "positive"),
        (["--policy", "h20"], "--policy 'h20': cannot read the cache 'h20' (unknown policy 'h20'"),
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--kv-memory", "lots"], "--kv-memory takes a size such as 512MiB or 2GiB, got 'lots'"),
        (["--min-budget", "0"], "--min-budget must be >= 1"),
    ],
)
def test_kvevict_serve_bad_flags_fail_clearly_before_loading(flags, message, capsys):
    from kvevict.cli import main

    assert main(["serve", "--model", "nowhere", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_kvevict_generate_default_budget_keeps_a_short_chat_whole(real_model):
    """Like the server's default: a token budget (1024) that a short chat never reaches."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevict.cli",
            "generate",
            "--prompt",
            "What is the capital of France? Answer in one word.",
            "--max-new-tokens",
            "12",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["budget"] == 1024 and res["prompt_tokens"] + res["new_tokens"] < 1024
    assert "Paris" in res["text"]
