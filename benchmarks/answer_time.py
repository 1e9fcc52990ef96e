"""Time to answer the demo's question (a pass key in about 1,000 tokens of essays) with the full
cache and with memory-budgeted caches, each the same prompt: found or not, bytes held, seconds.

    python benchmarks/answer_time.py --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 2 \\
        --caches 'full;memory=0.2;memory=0.2,policy=kvzip-pool;memory=0.1;memory=0.1,policy=kvzip-pool'

A cache is ``full`` or comma-separated ``generate`` keywords (``memory=0.2,policy=kvzip-pool``).
Rounds interleave the caches (each round visits every cache once, after one untimed warm-up call
of each); the table gives each cache's median seconds and its median ratio to the full cache
within a round. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def parse_cache(text: str) -> dict:
    if text.strip() == "full":
        return {"policy": "full"}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = float(value) if "." in value else int(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--caches", default="full;memory=0.2;memory=0.2,policy=kvzip-pool")
    p.add_argument("--out", default="results/answer_time.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.commands.demo import demo_prompt
    from kvevict.data.essays import haystack
    from kvevict.data.passkey import passkey_prompt
    from kvevict.generate import generate
    from kvevict.models import load_model

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    task = passkey_prompt(haystack(tok, args.tokens), args.depth, seed=args.tokens)
    prompt = demo_prompt(task, tok)  # a base model (Gemma 3) completes "... The pass key is", as in the demo
    caches = [c.strip() for c in args.caches.split(";") if c.strip()]
    runs = {c: [] for c in caches}
    for c in caches:  # warm-up: the compiled kernel's first build, allocator growth
        generate(model, tok, prompt, max_new_tokens=2, **parse_cache(c))
    for _ in range(args.rounds):
        for c in caches:
            runs[c].append(generate(model, tok, prompt, max_new_tokens=16, **parse_cache(c)))
    full = runs.get("full")
    rows = []
    for c in caches:
        r = runs[c][-1]
        secs = [x.seconds for x in runs[c]]
        ratio = statistics.median(x.seconds / f.seconds for x, f in zip(runs[c], full)) if full else None
        rows.append(
            {
                "cache": c,
                "policy": r.policy,
                "storage": r.storage,
                "found": task.answer in r.text,
                "answer": r.text,
                "kv_share": r.kv_bytes / r.full_kv_bytes,
                "seconds": secs,
                "ratio_to_full": ratio,
            }
        )
    print(
        f"pass key {task.answer} at {args.depth:.0%} of a {runs[caches[0]][0].prompt_tokens}-token prompt; "
        f"{args.model} {args.dtype}, {args.threads} threads, {args.rounds} rounds\n"
    )
    print("| cache | policy, storage | found | KV held (of 16-bit stock) | seconds (median) | x full |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = "" if r["ratio_to_full"] is None else f"{r['ratio_to_full']:.2f}x"
        print(
            f"| {r['cache']} | {r['policy']}, {r['storage'] or 'model dtype'} | {'yes' if r['found'] else 'no'} | "
            f"{r['kv_share']:.1%} | {statistics.median(r['seconds']):.1f} | {ratio} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
