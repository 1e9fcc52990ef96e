"""Load check for a running ``kvevict serve``: N requests one after another, then the same N at
once (batched continuously by the server), through the openai client. Prints a table and writes JSON.
The side-by-side load test against vLLM is ``python benchmarks/serve_load.py`` (docs/results/serving.md).

    kvevict serve --model smollm2-135m --max-batch 8 &
    python examples/serve_load.py --n 8 --max-tokens 32 --out runs/serve_load.json

Both runs use greedy decoding, so the answers must match; the ratio of the two wall times is the
batching gain on this machine (taken in one run, so machine noise hits both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import openai

TOPICS = [
    "the sea",
    "a mountain",
    "an old library",
    "a night train",
    "a small garden",
    "the desert",
    "a busy market",
    "a winter forest",
    "a lighthouse",
    "a river town",
    "a space station",
    "a bakery",
]


def prompts(n: int) -> list[str]:
    return [
        f"Write a short paragraph describing {TOPICS[i % len(TOPICS)]} at dawn, in the style of a travel "
        f"guide. Mention three details a visitor would notice first. (request {i})"
        for i in range(n)
    ]


async def run(url, n, max_tokens, policy, budget):
    extra = {"kv_policy": policy} if budget is None else {"kv_policy": policy, "kv_budget": budget}
    kw = dict(max_tokens=max_tokens, extra_body=extra)
    async with openai.AsyncOpenAI(base_url=url, api_key="kvevict", max_retries=0, timeout=900) as client:
        model = (await client.models.list()).data[0].id

        async def one(p):
            return await client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], **kw)

        ps = prompts(n)
        t0 = time.perf_counter()
        seq = [await one(p) for p in ps]
        t_seq = time.perf_counter() - t0
        t0 = time.perf_counter()
        conc = await asyncio.gather(*(one(p) for p in ps))
        t_conc = time.perf_counter() - t0
    return seq, t_seq, conc, t_conc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=None, help="kv_budget (default: the server's)")
    p.add_argument("--out", default="runs/serve_load.json")
    a = p.parse_args(argv)
    seq, t_seq, conc, t_conc = asyncio.run(run(a.url, a.n, a.max_tokens, a.policy, a.budget))
    tokens = sum(r.usage.completion_tokens for r in seq)
    same = sum(s.choices[0].message.content == c.choices[0].message.content for s, c in zip(seq, conc))
    held = sum(r.usage.kv_bytes for r in conc)
    full = sum(r.usage.kv_bytes_full for r in conc)
    rows = [("one at a time", t_seq, tokens / t_seq), (f"{a.n} at once", t_conc, tokens / t_conc)]
    print(
        f"{a.n} requests x {a.max_tokens} tokens, kv_policy={a.policy} kv_budget={a.budget}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'mode':<15} {'wall s':>8} {'tokens/s':>9}")
    for name, t, tps in rows:
        print(f"{name:<15} {t:>8.1f} {tps:>9.1f}")
    print(
        f"batching gain: {t_seq / t_conc:.2f}x; identical answers: {same}/{a.n}; "
        f"KV held per request {held / a.n / 2**20:.2f} MiB vs full {full / a.n / 2**20:.2f} MiB"
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "n": a.n,
                "max_tokens": a.max_tokens,
                "policy": a.policy,
                "budget": a.budget,
                "seconds_sequential": t_seq,
                "seconds_concurrent": t_conc,
                "tokens": tokens,
                "identical": same,
                "kv_bytes": held,
                "kv_bytes_full": full,
                "loadavg": os.getloadavg()[0],
            },
            indent=1,
        )
    )
    return 0 if same == a.n else 1


if __name__ == "__main__":
    sys.exit(main())
