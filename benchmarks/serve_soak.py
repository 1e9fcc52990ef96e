"""Soak benchmark for ``kvevict serve`` (not a test): N clients through the real openai
client on loopback for a while, in waves, against a ``kvevict serve`` subprocess.

Each client loops: a short chat or a long prompt (1 in 4), streamed or not (half), and 1 in 8
goes away early (a stream closed after a few chunks, or a plain request cancelled). Every answer
that completes is checked against the same prompt answered alone (greedy) before the load; 429s
are counted apart from errors. Between waves every client pauses: the server's K/V bytes held
must be back to zero then. RSS of the server and its K/V bytes are sampled every second.

    python benchmarks/serve_soak.py                       # 64 clients, 600 s, smollm2-135m
    python benchmarks/serve_soak.py --duration 150 --wave 30 --out soak.json

Prints a table; writes every figure as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request

KEY = "soak-key"
SHORT = [
    "What is the capital of France?",
    "Name three colours.",
    "Give me a word that rhymes with cat.",
    "What is 12 times 12?",
    "Say hello in Spanish.",
    "What day comes after Monday?",
]
SENTENCE = "The fox ran across the field while the crow watched from the old oak tree. "


def long_prompts(repeats: list[int]) -> list[str]:
    return ["Here is a story. " + SENTENCE * n + "Summarise the story in one sentence." for n in repeats]


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load in all (default 600)")
    p.add_argument("--wave", type=float, default=60.0, help="seconds per wave; clients pause between waves")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of the pause between waves")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--long", default="20,40", help="long prompts: this many repeats of a 16-word sentence each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more flags for kvevict serve, e.g. '--max-queue 16'")
    p.add_argument("--out", default="serve_soak.json")
    return p


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
    return 0.0


def start_server(a) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvevict.cli",
        "serve",
        "--model",
        a.model,
        "--port",
        str(a.port),
        "--threads",
        str(a.threads),
        "--api-key",
        KEY,
        *a.serve_args.split(),
    ]
    # its output to a file: an unread pipe would fill and block the server
    log = open(a.out + ".server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvevict serve exited: see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvevict serve did not come up in 300 s")


def request_kw(a, prompt: str, stream: bool) -> dict:
    return dict(
        model=a.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=a.max_tokens,
        temperature=0,
        stream=stream,
    )


async def ask(client, a, prompt: str, stream: bool, leave_after: int | None) -> dict:
    """One request; returns what happened: outcome, text, latency (s), time to first token (s)."""
    import openai

    t0 = time.perf_counter()
    try:
        if not stream:
            call = client.chat.completions.create(**request_kw(a, prompt, False))
            if leave_after is not None:  # the client gives up mid-request: the connection closes
                try:
                    await asyncio.wait_for(call, 0.05 * leave_after)
                except asyncio.TimeoutError:
                    return {"outcome": "left"}
                return {"outcome": "left-too-late"}
            r = await call
            dt = time.perf_counter() - t0
            return {"outcome": "ok", "text": r.choices[0].message.content, "latency": dt, "ttft": dt}
        parts, ttft, n = [], None, 0
        s = await client.chat.completions.create(**request_kw(a, prompt, True))
        async for c in s:
            if c.choices and c.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(c.choices[0].delta.content)
                n += 1
                if leave_after is not None and n >= leave_after:
                    await s.close()
                    return {"outcome": "left"}
        return {"outcome": "ok", "text": "".join(parts), "latency": time.perf_counter() - t0, "ttft": ttft}
    except openai.RateLimitError:
        return {"outcome": "429"}
    except Exception as err:  # counted and listed, never raised: the soak goes on
        return {"outcome": "error", "error": f"{type(err).__name__}: {err}"[:200]}


async def load(a, url: str) -> tuple[list, list, dict]:
    import openai

    LONG = long_prompts([int(n) for n in a.long.split(",")])
    prompts = SHORT + LONG
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600) as client:
        reference = {}
        for p in prompts:  # each prompt alone, before the load: what every answer must equal
            alone = await ask(client, a, p, False, None)
            if alone["outcome"] != "ok":
                raise SystemExit(f"the single-request run of {p[:40]!r} failed: {alone}")
            reference[p] = alone["text"]
        results, samples, pauses = [], [], []
        end = time.monotonic() + a.duration
        stop_wave = asyncio.Event()

        async def client_loop(i: int):
            rng = random.Random(a.seed * 1000 + i)
            while not stop_wave.is_set():
                p = rng.choice(LONG) if rng.random() < 0.25 else rng.choice(SHORT)
                stream = rng.random() < 0.5
                leave = rng.randint(1, 6) if rng.random() < 0.125 else None
                r = await ask(client, a, p, stream, leave)
                r.update(prompt=p, stream=stream)
                results.append(r)

        async def sampler():
            import psutil

            proc = psutil.Process(a.server_pid)
            while True:
                samples.append(
                    {
                        "t": time.monotonic(),
                        "rss": proc.memory_info().rss,
                        "kv_bytes": await asyncio.to_thread(metric, url, "kvevict_kv_bytes_held"),
                        "running": await asyncio.to_thread(metric, url, "kvevict_running_sequences"),
                    }
                )
                await asyncio.sleep(1.0)

        sampling = asyncio.create_task(sampler())
        t_start = time.monotonic()
        while time.monotonic() < end:
            stop_wave.clear()
            clients = [asyncio.create_task(client_loop(i)) for i in range(a.clients)]
            await asyncio.sleep(min(a.wave, max(0.0, end - time.monotonic())))
            stop_wave.set()  # each client ends after its current request
            await asyncio.gather(*clients)
            await asyncio.sleep(a.pause)  # the last rows leave at their next step
            import psutil

            pauses.append(
                {
                    "t": time.monotonic() - t_start,
                    "rss": psutil.Process(a.server_pid).memory_info().rss,
                    "kv_bytes": await asyncio.to_thread(metric, url, "kvevict_kv_bytes_held"),
                }
            )
        sampling.cancel()
        return results, samples, {"pauses": pauses, "reference": reference}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summarise(a, results, samples, extra) -> dict:
    ref = extra["reference"]
    ok = [r for r in results if r["outcome"] == "ok"]
    wrong = [r for r in ok if r["text"] != ref[r["prompt"]]]
    lat = [r["latency"] for r in ok]
    pauses = extra["pauses"]
    tail = [p for p in pauses if p["t"] >= 0.2 * a.duration] or pauses  # past warm-up (the issue: last 8 of 10 min)
    rss = [p["rss"] for p in tail]
    return {
        "model": a.model,
        "clients": a.clients,
        "duration_s": a.duration,
        "wave_s": a.wave,
        "requests": len(results),
        "completed": len(ok),
        "wrong_answers": len(wrong),
        "left_early": sum(r["outcome"] in ("left", "left-too-late") for r in results),
        "rejected_429": sum(r["outcome"] == "429" for r in results),
        "errors": sum(r["outcome"] == "error" for r in results),
        "error_kinds": sorted({r["error"] for r in results if r["outcome"] == "error"})[:5],
        "latency_p50_s": pct(lat, 0.5),
        "latency_p99_s": pct(lat, 0.99),
        "ttft_p50_s": pct([r["ttft"] for r in ok if r["ttft"]], 0.5),
        "ttft_p99_s": pct([r["ttft"] for r in ok if r["ttft"]], 0.99),
        "rss_at_pauses_mib": [round(p["rss"] / 2**20, 1) for p in pauses],
        "rss_spread_after_warmup": (max(rss) - min(rss)) / min(rss) if rss else None,
        "kv_bytes_at_pauses": [p["kv_bytes"] for p in pauses],
        "kv_bytes_peak": max((s["kv_bytes"] for s in samples), default=0),
        "running_peak": max((s["running"] for s in samples), default=0),
        "wrong_examples": [
            {"prompt": r["prompt"][:60], "got": r["text"][:80], "alone": ref[r["prompt"]][:80]} for r in wrong[:3]
        ],
    }


def main(argv=None) -> int:
    a = args_parser().parse_args(argv)
    url = f"http://127.0.0.1:{a.port}"
    proc = start_server(a)
    a.server_pid = proc.pid
    try:
        results, samples, extra = asyncio.run(load(a, url))
    finally:
        proc.terminate()  # SIGTERM: the drain; nothing is in flight by now
        code = proc.wait(60)
    out = summarise(a, results, samples, extra)
    out["server_exit_status"] = code
    rows = [
        ("requests", out["requests"]),
        ("completed", out["completed"]),
        ("wrong answers", out["wrong_answers"]),
        ("left early", out["left_early"]),
        ("429", out["rejected_429"]),
        ("errors", out["errors"]),
        ("latency p50 / p99 (s)", f"{out['latency_p50_s']:.2f} / {out['latency_p99_s']:.2f}"),
        ("TTFT p50 / p99 (s)", f"{out['ttft_p50_s']:.2f} / {out['ttft_p99_s']:.2f}"),
        ("RSS at pauses (MiB)", out["rss_at_pauses_mib"]),
        ("RSS spread after warm-up", f"{100 * (out['rss_spread_after_warmup'] or 0):.2f}%"),
        ("K/V bytes held at pauses", out["kv_bytes_at_pauses"]),
        ("K/V bytes peak", out["kv_bytes_peak"]),
        ("most running at once", out["running_peak"]),
        ("server exit status", code),
    ]
    print(f"| soak: {a.clients} clients, {a.duration:g} s, {a.model} | |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if not out["wrong_answers"] and not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
