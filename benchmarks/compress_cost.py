"""What compressing a context costs, policy by policy, against a plain prefill of it: wall and CPU
seconds of ``kvevict.compress(model, tok, ids, POLICY, memory=...)`` next to the stock cache's
forward over the same ids (SDPA, ``logits_to_keep=1``).

    python benchmarks/compress_cost.py --model smollm2-135m --tokens 2048 --threads 1 --reps 3 \\
        --policies kvzip-pool,kvzip,snapkv,ada-snapkv,expected,knorm,h2o

CPU seconds (``time.process_time``) are the cost on a machine other processes keep busy, where wall
seconds measure the neighbours as much as the work: with one thread the two agree on a quiet
machine. Each rep visits every arm once, after one untimed warm-up call of each; the table gives
medians, and each arm's CPU seconds over the prefill's. Writes JSON (``--out``) with the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

PREFILL = "prefill (stock cache)"


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def arms(model, tok, ids: torch.Tensor, policies: list[str], memory: float) -> dict:
    """name -> a call: the plain prefill, then one compression per policy."""
    from transformers import DynamicCache

    from kvevict.compress import compress

    @torch.no_grad()
    def prefill():
        model.set_attn_implementation("sdpa")
        model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

    out = {PREFILL: prefill}
    for policy in policies:
        out[policy] = lambda p=policy: compress(model, tok, ids, p, memory=memory)
    return out


def measure(calls: dict, reps: int) -> list[dict]:
    """One row per arm: its wall and CPU seconds (each rep), medians, CPU over the prefill's."""
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}.")
    for fn in calls.values():
        fn()  # warm-up
    runs: dict = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            runs[name].append(timed(fn))
    base = statistics.median(c for _, c in runs[PREFILL])
    rows = []
    for name, v in runs.items():
        cpu = statistics.median(c for _, c in v)
        wall = statistics.median(w for w, _ in v)
        rows.append({"arm": name, "wall_s": wall, "cpu_s": cpu, "cpu_vs_prefill": cpu / base, "runs": v})
    return rows


def table(res: dict) -> str:
    lines = [
        f"{res['context_tokens']} context tokens; {res['model']} {res['dtype']}, {res['threads']} threads, "
        f"memory={res['memory']}, {res['reps']} reps (median)\n",
        "| arm | wall s | CPU s | CPU x prefill |",
        "|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['arm']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['cpu_vs_prefill']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2048, help="the essay context's length")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--memory", type=float, default=0.2)
    p.add_argument("--policies", default="kvzip-pool,kvzip,snapkv,ada-snapkv,expected,knorm,h2o")
    p.add_argument("--out", default="results/compress_cost.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.compress import encode_context
    from kvevict.data.essays import haystack
    from kvevict.models import load_model

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    ids, _ = encode_context(tok, haystack(tok, args.tokens))
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    res = {k: getattr(args, k) for k in ("model", "dtype", "threads", "reps", "memory")}
    res["context_tokens"] = ids.shape[1]
    res["rows"] = measure(arms(model, tok, ids, policies, args.memory), args.reps)
    res["command"] = "python benchmarks/compress_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(table(res))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
