"""Every token kept, stored at 8 / 4 / 2 bits, keys as the model makes them ("raw") or centred and
rotated ("rotated", kvevict.keyspace): does the model still answer, and what does it cost in NLL?

Three probes on one model, nothing evicted (a covering budget):
  - the demo's pass key (about 1,000 tokens of essays, the key at 50%): found or not;
  - a 41-token coding chat ("the n-th Fibonacci number"): the first 40 greedy tokens, and whether
    they equal the full cache's;
  - teacher-forced NLL of 512 tokens of other essays after a 512-token prefix, fed 64 at a time
    (each chunk reads the earlier ones from the cache's storage).

    python benchmarks/key_storage.py --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 2

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CONFIGS = {
    "full": dict(policy="full"),
    "model dtype": dict(policy="h2o", budget=4096),
    "int8 raw": dict(policy="h2o", budget=4096, kv_bits=8, keys="raw"),
    "int8 rotated": dict(policy="h2o", budget=4096, kv_bits=8, keys="rotated"),
    "int4 raw": dict(policy="h2o", budget=4096, kv_bits=4, keys="raw"),
    "int4 rotated": dict(policy="h2o", budget=4096, kv_bits=4, keys="rotated"),
    "int2 rotated": dict(policy="h2o", budget=4096, kv_bits=2, keys="rotated"),
}
FIB = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


@torch.no_grad()
def nll(model, ids, kw, prefix=512, chunk=64) -> float:
    from transformers import DynamicCache

    import kvevict

    model.set_attn_implementation("sdpa")
    cache = DynamicCache() if kw["policy"] == "full" else kvevict.make_cache(model, **kw)
    out = model(ids[:, :prefix], cache=cache)
    last, total = out.logits[:, -1:], 0.0
    for s in range(prefix, ids.shape[1], chunk):
        out = model(ids[:, s : s + chunk], cache=cache)
        logits = torch.cat([last, out.logits[:, :-1]], 1).float()[0]
        total += torch.nn.functional.cross_entropy(logits, ids[0, s : s + chunk], reduction="sum").item()
        last = out.logits[:, -1:]
    return total / (ids.shape[1] - prefix)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--out", default="results/key_storage.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.data.essays import haystack
    from kvevict.data.passkey import for_tokenizer, passkey_prompt
    from kvevict.generate import generate
    from kvevict.models import load_model

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    task = passkey_prompt(haystack(tok, 1000), 0.5, seed=1000)
    prompt = for_tokenizer(task.messages, task.lead, tok)
    text = tok(haystack(tok, 1100, start=7), return_tensors="pt").input_ids[:, :1024]
    rows, ref = [], None
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        kw = CONFIGS[name]
        t0 = time.perf_counter()
        key = generate(model, tok, prompt, max_new_tokens=12, **kw).text
        fib = generate(model, tok, FIB, max_new_tokens=40, **kw).text
        ref = fib if name == "full" else ref
        row = {
            "config": name,
            "passkey": task.answer in key,
            "answer": key,
            "fib": fib,
            "fib_as_full": None if ref is None else fib == ref,
            "nll": nll(model, text, kw),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(
            f"{name:14s} passkey {'yes' if row['passkey'] else 'no ':3s} fib=full {str(row['fib_as_full']):5s} "
            f"nll {row['nll']:.4f}  {fib[:40]!r}",
            flush=True,
        )
    base = next((r["nll"] for r in rows if r["config"] == "full"), None)
    print("\n| storage (every token kept) | pass key | chat as full | NLL | vs full |\n|---|---|---|---|---|")
    for r in rows:
        rel = "" if base is None else f"{r['nll'] / base - 1:+.2%}"
        print(
            f"| {r['config']} | {'found' if r['passkey'] else 'missed'} | {r['fib_as_full']} | {r['nll']:.4f} | {rel} |"
        )
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
