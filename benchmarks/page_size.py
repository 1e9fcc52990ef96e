"""Paged storage: what the page size costs and saves (``python benchmarks/page_size.py``).

A tier grows ``kvevict.storage.paged.PAGE`` slots at a time; each growth reallocates the tier (one copy of
it), so a small page costs copies while decoding and a large one holds up to a page of empty slots
per (layer, KV head). This measures both on the real model, in one process, interleaved:

- decode: the mean step while a sequence grows from ``--context`` tokens under a budget it never
  reaches (so every page boundary is crossed), for each page size, against storage allocated at
  the budget once (``prealloc``, what kvevict did before pages);
- bytes: a short chat under a large token budget, held by kvevict with each page size against the
  stock ``DynamicCache`` for the same tokens.
Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvevict.cache import make_cache
from kvevict.storage import paged

PREALLOC = 1 << 30  # a page as large as any budget: allocated once, at the budget


def _stock_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


@torch.no_grad()
def decode_steps(model, page: int, context: int, batch: int, steps: int, budget: int) -> float:
    """Mean seconds per decode step from ``context`` to ``context + steps`` tokens at ``page``."""
    paged.PAGE = page
    cache = make_cache(model, "h2o", budget)
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = torch.full((batch, 1), 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
    return (time.perf_counter() - t0) / steps


@torch.no_grad()
def short_chat_bytes(model, tok, page: int, budget: int, new_tokens: int = 16) -> tuple[int, int]:
    """(kvevict's bytes, the stock cache's bytes) after a short chat and ``new_tokens`` answered."""
    paged.PAGE = page
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    held = []
    for cache in (make_cache(model, "h2o", budget), DynamicCache(config=model.config)):
        model.generate(**ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        held.append(cache.kv_bytes() if hasattr(cache, "kv_bytes") else _stock_bytes(cache))
    return held[0], held[1]


def main(argv=None) -> int:
    from kvevict.models import load_model

    p = argparse.ArgumentParser(prog="python benchmarks/page_size.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pages", default="16,32,64,128", help="page sizes to compare with prealloc")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--budget", type=int, default=4096, help="token budget (never reached while decoding)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/pages.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    sizes = [int(x) for x in a.pages.split(",")] + [PREALLOC]
    name = {s: ("prealloc" if s == PREALLOC else str(s)) for s in sizes}
    keep = paged.PAGE
    times: dict[int, list[float]] = {s: [] for s in sizes}
    try:
        for r in range(a.rounds):  # rotated order: a noisy minute hits every page size alike
            for s in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                times[s].append(decode_steps(model, s, a.context, a.batch, a.steps, a.budget))
        chat = {s: short_chat_bytes(model, tok, s, 1024) for s in sizes}
    finally:
        paged.PAGE = keep
    base = statistics.median(times[PREALLOC])
    rows = []
    print(
        f"decode from {a.context} tokens, batch {a.batch}, {a.steps} steps, budget {a.budget}, "
        f"{a.threads} thread(s), {a.rounds} rounds; short chat: h2o budget 1024, 16 new tokens"
    )
    print(f"{'page':>9} | {'step ms':>8} | {'vs prealloc':>11} | {'chat bytes':>11} | {'vs stock':>8}")
    for s in sizes:
        med = statistics.median(times[s])
        held, stock = chat[s]
        rows.append(
            {
                "page": name[s],
                "step_s": times[s],
                "median_s": med,
                "vs_prealloc": med / base,
                "chat_bytes": held,
                "stock_bytes": stock,
                "chat_vs_stock": held / stock,
            }
        )
        print(f"{name[s]:>9} | {med * 1e3:8.1f} | {med / base:10.3f}x | {held:11,d} | {held / stock:7.2f}x")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
