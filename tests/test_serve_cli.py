"""``kvevict serve`` as a user starts it: a subprocess on loopback, always stopped."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from kvevict.serve.server import free_port  # noqa: E402
from tiny_chat_model import save_tiny_chat_model  # noqa: E402


def test_kvevict_serve_starts_answers_and_stops(tmp_path):
    folder = save_tiny_chat_model(tmp_path / "tiny")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvevict.cli",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--served-name",
            "tiny",
            "--policy",
            "recency",
            "--budget",
            "12",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert json.load(r)["status"] == "ok"
                    break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up in 90 s"
                time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="t", max_retries=0, timeout=30)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=6
        )
        assert r.usage.kv_policy == "recency" and r.usage.kv_budget_tokens == 12  # the CLI's defaults
    finally:
        proc.terminate()
        proc.wait(30)


def _start(folder, port, *flags):
    """``kvevict serve`` on the tiny model, returned once /health answers."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvevict.cli",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--served-name",
            "tiny",
            "--threads",
            "1",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            assert time.monotonic() < deadline, "server did not come up in 90 s"
            time.sleep(0.25)


def test_sigterm_drains_503_for_new_requests_in_flight_ones_finish_exit_0(tmp_path):
    """Issue 44: SIGTERM to a real ``kvevict serve`` process with one request decoding and seven
    waiting (--max-batch 1): a request sent after it gets 503, all eight finish whole, and the
    process exits with status 0."""
    import asyncio
    import signal

    folder = save_tiny_chat_model(tmp_path / "tiny")
    port = free_port()
    proc = _start(folder, port, "--policy", "full", "--max-batch", "1", "--drain-timeout", "120", "--api-key", "k")
    try:
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=480,
            extra_body={"ignore_eos": True},
        )

        async def main():
            async with openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=300
            ) as ac:
                first = await ac.chat.completions.create(**kw, stream=True)
                rest = [asyncio.create_task(ac.chat.completions.create(**kw)) for _ in range(7)]
                await first.__anext__()  # decoding has begun
                await asyncio.sleep(0.2)  # the others are queued
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(openai.InternalServerError) as refused:  # 503
                    await ac.with_options(max_retries=0).chat.completions.create(**{**kw, "max_tokens": 2})
                streamed = [c async for c in first]
                return refused.value, streamed, await asyncio.gather(*rest)

        refused, streamed, rest = asyncio.run(main())
        assert refused.status_code == 503 and "shutting down" in str(refused)
        assert streamed[-1].choices[0].finish_reason == "length"
        assert [r.usage.completion_tokens for r in rest] == [480] * 7
        assert proc.wait(60) == 0
        assert "draining" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


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
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["budget"] == 1024 and res["prompt_tokens"] + res["new_tokens"] < 1024
    assert "Paris" in res["text"]
