"""Quick paired NLL cost of cache configurations against the full cache, on the ppl task's windows
(the same text streamed through every cache in lockstep, 32 tokens a step), with the bytes each held.
What chose the group size and the memory rule (docs/results/quality-per-byte.md):

    python -m kvevict.eval.storage_pilot --windows 2 --config int4:kv_bits=4 \\
        --config int8+int4@0.2:kv_bits=8,evicted_bits=4,budget=0.2 --config h2o@0.2:budget=0.2
"""

from __future__ import annotations

import argparse
import math

import torch

CFG_KEYS = {"kv_bits": int, "evicted_bits": int, "evicted_budget": float, "group": int, "budget": float, "policy": str}


def parse_config(text: str) -> tuple[str, dict]:
    """'NAME:kv_bits=4,budget=0.55' -> ('NAME', {'kv_bits': 4, 'budget': 0.55})."""
    name, _, body = text.partition(":")
    kw = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in CFG_KEYS:
            raise ValueError(f"--config takes NAME:KEY=VALUE,... with keys {', '.join(CFG_KEYS)}; got {text!r}.")
        try:
            kw[key] = CFG_KEYS[key](value)
        except ValueError:
            raise ValueError(f"--config {name}: {key} takes {CFG_KEYS[key].__name__} values, got {value!r}.") from None
    return name, kw


@torch.no_grad()
def run(model, tokenizer, configs: list[tuple[str, dict]], windows: int, tokens: int = 1024, chunk: int = 32):
    from transformers import DynamicCache

    from ..attention import ATTN_NAME, register
    from ..cache import make_cache
    from . import metrics
    from .tasks.ppl import PerplexityTask

    register()
    model.set_attn_implementation(ATTN_NAME)
    out = {name: [] for name, _ in configs}
    for sample in PerplexityTask(tokens=tokens).samples(tokenizer, windows):
        ids = torch.tensor([sample.data["ids"]])
        n = ids.shape[1]
        caches = {}
        for name, kw in configs:
            kw = dict(kw)
            policy, budget = kw.pop("policy", "h2o"), kw.pop("budget", 1.0)
            caches[name] = make_cache(model, policy, max(1, math.ceil(budget * n - 1e-9)), **kw)
            caches[name].set_prompt_length(n)  # the window is the prompt (sizes a mixed cache's second tier)
        ref_cache, ref, nll = DynamicCache(config=model.config), [], {k: [] for k in caches}
        for s in range(0, n - 1, chunk):
            e = min(n - 1, s + chunk)
            x, y = ids[:, s:e], ids[0, s + 1 : e + 1]
            ref += metrics.token_nll(model(x, cache=ref_cache).logits[0], y).tolist()
            for k, c in caches.items():
                nll[k] += metrics.token_nll(model(x, cache=c).logits[0], y).tolist()
        for k, c in caches.items():
            diff = sum(nll[k]) / len(nll[k]) - sum(ref) / len(ref)
            out[k].append((sample.id, diff, c.kv_bytes() / c.full_kv_bytes()))
            print(
                f"{sample.id} {k}: NLL - full {diff:+.4f} nats/token, bytes {c.kv_bytes() / c.full_kv_bytes():.1%}",
                flush=True,
            )
    return out


def main(argv=None) -> int:
    from ..commands._common import setup_threads
    from ..models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=2, help="ppl windows (cycling wikipedia, essays, austen)")
    p.add_argument("--config", action="append", required=True, help="NAME:KEY=VALUE,... (repeatable)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tokens", type=int, default=1024, help="window length (tokens)")
    args = p.parse_args(argv)
    try:
        configs = [parse_config(c) for c in args.config]
    except ValueError as err:
        p.error(str(err))
    setup_threads(args)
    model, tok = load_model(args.model)
    res = run(model, tok, configs, args.windows, tokens=args.tokens)
    print("\n| config | bytes (of 16-bit stock) | NLL − full, mean over windows | per window |\n|---|---|---|---|")
    for name, vals in res.items():
        mean = sum(v[1] for v in vals) / len(vals)
        print(
            f"| {name} | {sum(v[2] for v in vals) / len(vals):.1%} | {mean:+.4f} | "
            f"{', '.join(f'{v[1]:+.4f}' for v in vals)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
