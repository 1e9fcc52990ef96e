"""Prefill (+ short decode) jobs, each in its own process so its peak RSS is its own: kvevict's
modes through the script ``prefill_child.py``, kvpress presses through ``kvpress_peer.py`` in the
kvpress virtual environment. Jobs run round-robin over ``repeats`` rounds, like the decode grid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvevict.peers.kvpress_presses import PRESSES
from kvevict.peers.locations import find, hint

from .machine import load_average
from .stats import summary

PEER_SCRIPT = Path(__file__).with_name("kvpress_peer.py")
CHILD_SCRIPT = Path(__file__).with_name("prefill_child.py")
VENV_COMMAND = hint("kvpress")


def kvpress_python() -> Path | None:
    """The kvpress environment's interpreter (see kvevict.peers.locations for where it is looked for)."""
    return find("kvpress")


def kvevict_jobs(
    model: str, modes: list[str], policy: str, budget: float, context: int, steps: int, threads: int, seed: int
) -> list[dict]:
    jobs = []
    for mode in modes:
        job = {
            "model": model,
            "mode": mode,
            "context": context,
            "decode_steps": steps,
            "threads": threads,
            "seed": seed,
        }
        if mode == "kvevict":
            job.update(policy=policy, budget=budget)
        label = f"kvevict {policy}@{budget:g}" if mode == "kvevict" else f"stock {mode}"
        jobs.append({"label": label, "argv": [sys.executable, str(CHILD_SCRIPT), json.dumps(job)], "job": job})
    return jobs


def kvpress_jobs(
    python: Path, model_dir: Path, presses: list[str], budget: float, context: int, steps: int, threads: int, seed: int
) -> list[dict]:
    jobs = []
    for press in presses:
        cls, attn = PRESSES[press]  # resolved here: the peer's environment cannot import kvevict
        job = {
            "model_dir": str(model_dir),
            "press": press,
            "press_class": cls,
            "attn_implementation": attn,
            "compression_ratio": round(1.0 - budget, 6),
            "context": context,
            "decode_steps": steps,
            "threads": threads,
            "seed": seed,
        }
        jobs.append(
            {
                "label": f"kvpress {press}@{budget:g}",
                "argv": [str(python), str(PEER_SCRIPT), json.dumps(job)],
                "job": job,
            }
        )
    return jobs


def run_jobs(jobs: list[dict], repeats: int, timeout: float = 1800, log=print) -> list[dict]:
    """Run every job ``repeats`` times round-robin; a failing job is recorded with its error."""
    runs: dict[str, list[dict]] = {j["label"]: [] for j in jobs}
    errors: dict[str, str] = {}
    for r in range(repeats):
        for j in jobs:
            if j["label"] in errors:
                continue
            t0 = time.perf_counter()
            try:
                res = subprocess.run(
                    j["argv"],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
                    check=False,
                )
            except subprocess.TimeoutExpired:
                errors[j["label"]] = f"timed out after {timeout:.0f} s"
                continue
            line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
            if res.returncode != 0 or not line.startswith("{"):
                errors[j["label"]] = (res.stderr.strip().splitlines() or ["no output"])[-1][:300]
                log(f"  {j['label']}: FAILED: {errors[j['label']]}")
                continue
            runs[j["label"]].append(json.loads(line))
            out = runs[j["label"]][-1]
            log(
                f"  {j['label']:>34}: prefill {out['prefill_s']:7.2f} s, peak RSS {out['peak_rss_bytes'] / 2**30:5.2f} GiB,"
                f" decode {out['decode_step_s'] * 1e3:6.1f} ms/step ({time.perf_counter() - t0:.0f} s, load {load_average()})"
            )
    out = []
    for j in jobs:
        rs = runs[j["label"]]
        rec = {"label": j["label"], "job": j["job"], "runs": rs}
        if rs:
            for key in (
                "prefill_s",
                "decode_step_s",
                "peak_rss_bytes",
                "peak_rss_prefill_bytes",
                "rss_loaded_bytes",
                "kv_bytes_after_prefill",
            ):
                rec[key] = summary([x[key] for x in rs])
        if j["label"] in errors:
            rec["error"] = errors[j["label"]]
        out.append(rec)
    return out
