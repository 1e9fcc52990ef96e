"""Streaming language modelling one token a step, the way decoding feeds a cache: each window of
real text goes through the model a token at a time (every step a decode step, so a cache that
evicts in batches does so), and the mean negative log-likelihood of its tokens is compared with
the full cache's on the same windows (paired). Prints a table and writes JSON.

    python benchmarks/stream_nll.py --caches 'h2o@256+slack=1;h2o@256;h2o@256+slack=32' --windows 4 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = "full"


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, spec: str) -> float:
    """Mean NLL of ids[1:] given what came before, fed one token a step into the cache ``spec``."""
    from transformers import DynamicCache

    import kvevict

    if spec == FULL:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        cache = kvevict.make_cache(model, spec)
    total = 0.0
    for i in range(ids.shape[1] - 1):
        logits = model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[:, -1].float()
        total -= torch.log_softmax(logits, -1)[0, ids[0, i + 1]].item()
    return total / (ids.shape[1] - 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--caches", default="h2o@256+slack=1;h2o@256;memory=0.25+slack=1;memory=0.25")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--dtype", default=None, help="the model's dtype (bfloat16 for Qwen2.5-1.5B on a CPU with AVX-512 BF16)"
    )
    p.add_argument("--out", default="results/stream_nll.json")
    a = p.parse_args(argv)
    import kvevict
    from kvevict.data.needle_once import _wikipedia_text

    torch.set_num_threads(a.threads)
    model, tok = kvevict.load_model(a.model, dtype=getattr(torch, a.dtype) if a.dtype else None)
    ids = tok(_wikipedia_text(), return_tensors="pt")["input_ids"]
    if ids.shape[1] < a.windows * a.tokens:
        raise ValueError(f"the text has {ids.shape[1]} tokens: give fewer --windows or --tokens.")
    windows = [ids[:, w * a.tokens : (w + 1) * a.tokens] for w in range(a.windows)]
    caches = [FULL] + [c for c in a.caches.split(";") if c and c != FULL]
    nll: dict = {c: [] for c in caches}
    for w, win in enumerate(windows):
        for c in caches:
            t0 = time.perf_counter()
            nll[c].append(window_nll(model, win, c))
            print(f"window {w}: {c}: nll {nll[c][-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for c in caches:
        diff = [x - f for x, f in zip(nll[c], nll[FULL])]
        sd = statistics.stdev(diff) if len(diff) > 1 else float("nan")
        rows.append(
            {
                "cache": c,
                "nll": statistics.mean(nll[c]),
                "ppl_x_full": math.exp(statistics.mean(diff)),
                "diff": statistics.mean(diff),
                "diff_half_width": 1.96 * sd / math.sqrt(len(diff)) if len(diff) > 1 else float("nan"),
                "windows": nll[c],
            }
        )
    print("| cache | mean NLL | perplexity x full | NLL - full, mean [95% normal interval] |\n|---|---|---|---|")
    for r in rows:
        lo, hi = r["diff"] - r["diff_half_width"], r["diff"] + r["diff_half_width"]
        print(f"| `{r['cache']}` | {r['nll']:.4f} | {r['ppl_x_full']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"model": a.model, "dtype": a.dtype, "tokens": a.tokens, "threads": a.threads, "rows": rows}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
