"""What a 16-bit dtype costs on this CPU: one prefill and one decode step of the stock model in
float32, bfloat16 and float16, the same weights cast, timed in interleaved rounds.

    python benchmarks/cpu_dtype.py --model qwen2.5-coder-1.5b --tokens 512 --threads 2 --out results/cpu_dtype.json

A CPU with AVX-512 BF16 or AMX runs bfloat16 products natively and a prefill gets faster; without
them torch emulates the type and it gets slower (``kvevict.models.warn_slow_cpu_dtype`` warns).
Ratios are against float32 in the same round; rounds rotate the order. Prints a table and writes
JSON with the CPU's capabilities.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

DTYPES = ("float32", "bfloat16", "float16")


@torch.no_grad()
def prefill_and_step(model, ids) -> tuple[float, float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    model(ids, cache=cache)
    t1 = time.perf_counter()
    model(ids[:, -1:], cache=cache)
    return t1 - t0, time.perf_counter() - t1


def run(model_name: str, dtypes: list[str], tokens: int, rounds: int, log=print) -> dict:
    from kvevict.models import load_model

    model, _ = load_model(model_name)
    # loaded in float32 (no warning), then cast: the same weights in every dtype
    models = {d: model if d == "float32" else copy.deepcopy(model).to(getattr(torch, d)) for d in dtypes}
    vocab = min(1000, model.config.get_text_config().vocab_size)
    ids = torch.randint(vocab // 10, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    for m in models.values():
        prefill_and_step(m, ids[:, :32])  # warm-up
    times: dict[str, list[tuple[float, float]]] = {d: [] for d in dtypes}
    for r in range(rounds):
        for d in dtypes[r % len(dtypes) :] + dtypes[: r % len(dtypes)]:
            times[d].append(prefill_and_step(models[d], ids))
    rows = []
    for d in dtypes:
        pre = [t[0] / b[0] for t, b in zip(times[d], times["float32"])]
        dec = [t[1] / b[1] for t, b in zip(times[d], times["float32"])]
        rows.append(
            {
                "dtype": d,
                "prefill_s": statistics.median(t[0] for t in times[d]),
                "step_s": statistics.median(t[1] for t in times[d]),
                "prefill_vs_float32": statistics.median(pre),
                "step_vs_float32": statistics.median(dec),
            }
        )
    log(
        f"| {model_name}, {tokens} tokens, {torch.get_num_threads()} threads | prefill s | x float32 | step s | x float32 |"
    )
    log("|---|---|---|---|---|")
    for row in rows:
        log(
            f"| {row['dtype']} | {row['prefill_s']:.2f} | {row['prefill_vs_float32']:.2f} | "
            f"{row['step_s']:.3f} | {row['step_vs_float32']:.2f} |"
        )
    caps = torch.cpu.get_capabilities()
    flags = {
        k: caps.get(k) for k in ("cpu_name", "avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    }
    log(f"CPU: {flags}")
    return {
        "model": model_name,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "cpu": flags,
        "rows": rows,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list; float32 is always timed (the baseline)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/cpu_dtype.json")
    args = p.parse_args(argv)
    dtypes = ["float32"] + [d for d in (x.strip() for x in args.dtypes.split(",")) if d and d != "float32"]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    result = run(args.model, dtypes, args.tokens, args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
