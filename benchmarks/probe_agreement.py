"""How well cheaper scores rank a prompt's keys as KVzip's reconstruction ranks them, on the probe's
held-out calibration texts (``kvevict.eval.probe_fit``): the model's probe where it has one,
``kvzip-sample``'s scores at each share, and the sample's reads alone (no fit). Per layer and KV
head over the keys a stock cache keeps: the Spearman correlation with KVzip's scores and the share
of KVzip's top 20% in the score's top 20%, averaged; and each score's seconds over the prefill's.
The prompt's last queries (the window both policies add) are left out: they read the question.

    python benchmarks/probe_agreement.py --model smollm2-135m --dtype float32 --threads 2 \\
        --texts 8,9 --shares 0.125,0.25,0.5 --out docs/results/probe/agreement-smollm2.json

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--texts", default="8,9", help="calibration texts (8 and 9: the probe fit's held-out ones)")
    p.add_argument("--shares", default="0.125,0.25,0.5")
    p.add_argument("--piece", type=int, default=32)
    p.add_argument("--out", default="results/probe_agreement.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from transformers import DynamicCache

    from kvevict.eval.probe_fit import agreement, calibration_ids
    from kvevict.models import load_model
    from kvevict.policies.kvzip import KVzip
    from kvevict.policies.sample import fitted, reconstructed
    from kvevict.probe import EPS, find
    from kvevict.stock import stock_windows

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa")
    probe = find(model)
    windows = stock_windows(model.config)
    rows: dict[str, list] = {}

    def judge(name, scores, seconds, prefill):
        rho, top = [], []
        for s, t, w in zip(scores, truth, windows):
            k = n if w is None else min(n, w)
            r, o = agreement(torch.log(s[0, :, -k:].float().T + EPS), torch.log(t[0, :, -k:].float().T + EPS))
            rho.append(r)
            top.append(o)
        rows.setdefault(name, []).append(
            {"spearman": sum(rho) / len(rho), "top20": sum(top) / len(top), "x_prefill": seconds / prefill}
        )

    for index in (int(t) for t in args.texts.split(",")):
        ids = calibration_ids(tok, args.tokens, index)
        n = ids.shape[1]
        context = DynamicCache()  # every layer keeps every key, as KVzip scores them
        t0 = time.perf_counter()
        model(ids, cache=context, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        truth = KVzip.record(model, tok, ids, context=context).scores
        judge("KVzip (reconstruction of the whole prompt)", truth, time.perf_counter() - t0, prefill)
        if probe is not None:
            t0 = time.perf_counter()
            got = [probe.scores(i, layer.keys, layer.values, n) for i, layer in enumerate(context.layers)]
            judge("the model's probe (kvzip-probe)", got, time.perf_counter() - t0, prefill)
        for share in (float(s) for s in args.shares.split(",")):
            t0 = time.perf_counter()
            measured, sampled = reconstructed(model, tok, ids, context, share, args.piece)
            reads = time.perf_counter() - t0
            got = [fitted(layer.keys, layer.values, s, sampled) for layer, s in zip(context.layers, measured)]
            judge(f"kvzip-sample, share {share}", got, time.perf_counter() - t0, prefill)
            judge(f"the sample's reads alone, share {share}", measured, reads, prefill)

    table = [
        {"score": name, **{k: statistics.mean(r[k] for r in runs) for k in ("spearman", "top20", "x_prefill")}}
        for name, runs in rows.items()
    ]
    print(
        f"{args.model} {args.dtype}, {args.threads} threads, calibration texts {args.texts} of {args.tokens} tokens\n"
    )
    print("| score | Spearman with KVzip's | top 20% held | seconds x the prefill's |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['score']} | {r['spearman']:.3f} | {r['top20']:.1%} | {r['x_prefill']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": table, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
