"""Paired comparison of two policies on the same samples of a finished grid:

    python -m kvevict.eval.compare results/quality --task ppl --budget 0.2 --metric top1 roco:h2o mas:h2o

prints mean(a - b) with its 95% t interval over the samples both policies ran.
"""

from __future__ import annotations

import argparse

from .records import load
from .stats import Interval, mean_ci


def paired(records: dict, task: str, a: str, b: str, budget, metric: str) -> Interval:
    def scores(policy):
        return {r["sample"]: r["scores"][metric] for r in records.values()
                if r["task"] == task and r["policy"] == policy and r.get("budget") == budget
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
    for pair in args.pairs:
        a, sep, b = pair.partition(":")
        if not sep:
            p.error(f"pairs are A:B, got {pair!r}")
        ci = paired(records, args.task, a, b, args.budget, args.metric)
        print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: {ci.fmt(4)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
