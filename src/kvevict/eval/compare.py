"""Paired comparison of two policies on the same samples of a finished grid:

    python -m kvevict.eval.compare results/quality --task ppl --budget 0.2 --metric top1 roco:h2o h2o:full

prints mean(a - b) with its 95% t interval over the samples both policies ran.
"""

from __future__ import annotations

import argparse

from .caches import FULL
from .records import load
from .stats import Interval, mean_ci


def paired(records: dict, task: str, a: str, b: str, budget, metric: str) -> Interval:
    def scores(policy):
        want = None if policy == FULL else budget  # the full cache's records have no budget
        return {r["sample"]: r["scores"][metric] for r in records.values()
                if r["task"] == task and r["policy"] == policy and r.get("budget") == want
                and metric in r.get("scores", {})}

    sa, sb = scores(a), scores(b)
    return mean_ci([sa[k] - sb[k] for k in sa if k in sb])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the eval output folder (records.jsonl)")
    p.add_argument("--task", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--metric", required=True)
    p.add_argument("pairs", nargs="+", help="A:B pairs of policy names")
    args = p.parse_args(argv)
    records = load(args.out)
    known = sorted({r["policy"] for r in records.values() if r["task"] == args.task})
    if not known:
        p.error(f"no records of task {args.task!r} in {args.out}")
    for pair in args.pairs:
        a, sep, b = pair.partition(":")
        if not sep:
            p.error(f"pairs are A:B, got {pair!r}")
        for name in (a, b):
            if name not in known:
                p.error(f"no {args.task} records of policy {name!r} in {args.out}; it has: {', '.join(known)}")
        ci = paired(records, args.task, a, b, args.budget, args.metric)
        if ci.n == 0:
            print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: no shared samples")
        elif ci.n == 1:
            print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: {ci.mean:+.4g} n=1")
        else:
            print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: {ci.mean:+.4g} "
                  f"[{ci.lo:+.4g}, {ci.hi:+.4g}] n={ci.n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
