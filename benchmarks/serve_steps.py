"""What bounds serving throughput on a small CPU: the server's own decode step (``DecodeBatch.step``)
timed at growing batch sizes, full cache against H2O, and one prompt's prefill, on SmolLM2.

    python benchmarks/serve_steps.py --threads 2

Each batch is built prompt by prompt: every prompt prefilled alone, then joined (the decode step
timed is the server's; the server now prefills prompts that arrive together in one forward). Per
(cache, batch): median ms per decode step over ``--steps`` steps, generated tokens/s = batch /
step time, and the median seconds to prefill one prompt. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def measure(model, policy, budget, prompt_len, sizes, steps, seed=0):
    """Grow one batch prompt by prompt (each prefilled alone, then joined); time ``steps`` decode
    steps whenever it reaches one of ``sizes``."""
    from kvevict.serve.batch import DecodeBatch

    g = torch.Generator().manual_seed(seed)
    batch, prefill_s, rows = None, [], []
    for size in range(1, max(sizes) + 1):
        prompt = torch.randint(100, 20000, (prompt_len,), generator=g).tolist()
        t0 = time.perf_counter()
        one, _ = DecodeBatch.prefill(model, prompt, policy, budget, None)
        prefill_s.append(time.perf_counter() - t0)
        if batch is None:
            batch = one
        else:
            batch.join(one)
        if size not in sizes:
            continue
        times = []
        for _ in range(steps + 1):  # the first step warms up
            t0 = time.perf_counter()
            batch.step([1] * size)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1000
        rows.append(
            {
                "cache": policy if budget is None else f"{policy} {budget}",
                "batch": size,
                "ms_per_step": round(ms, 1),
                "tokens_per_s": round(size / ms * 1000, 2),
                "prefill_s": round(statistics.median(prefill_s), 2),
                "kv_mib": round(batch.kv_bytes() / 2**20, 1),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1070, help="prompt tokens per sequence")
    p.add_argument("--budget", type=int, default=128, help="H2O's token budget")
    p.add_argument("--sizes", default="1,2,4,8,16", help="batch sizes")
    p.add_argument("--steps", type=int, default=6, help="timed decode steps per batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/serve_steps.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.attention import ATTN_NAME, register
    from kvevict.models import load_model

    model, _ = load_model("smollm2-135m")
    register()
    model.set_attn_implementation(ATTN_NAME)
    sizes = [int(s) for s in args.sizes.split(",")]
    with torch.inference_mode():
        rows = measure(model, "full", None, args.prompt, sizes, args.steps) + measure(
            model, "h2o", args.budget, args.prompt, sizes, args.steps
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    print(f"prompt {args.prompt} tokens, {args.threads} threads; decode step of the server's DecodeBatch")
    print(f"{'cache':<10} {'batch':>5} {'ms/step':>8} {'tok/s':>7} {'prefill s':>9} {'KV MiB':>7}")
    for r in rows:
        print(
            f"{r['cache']:<10} {r['batch']:>5} {r['ms_per_step']:>8} {r['tokens_per_s']:>7} "
            f"{r['prefill_s']:>9} {r['kv_mib']:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
