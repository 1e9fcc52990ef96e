"""Paired comparison of two policies on the same samples of a finished grid:

    python -m kvevict.eval.compare results/quality --task ppl --budget 0.2 --metric top1 roco:h2o h2o:full

prints mean(a - b) with its 95% t interval over the samples both policies ran (of one model: give
--model when the folder holds several). A policy written ``NAME@BUDGET`` is taken at its own
budget, so two caches holding the same bytes at different token budgets pair up:

    python -m kvevict.eval.compare results/ppl --task ppl --budget 0.2 --metric nll h2o/int8@0.3346:mem

``--baseline FOLDER`` adds a second run of the same samples, its policies named ``base.NAME``, so
two runs (two versions of the code, two rules) pair sample by sample: ``mem:base.mem``.
"""

from __future__ import annotations

import argparse

from .caches import FULL
from .intervals import Interval
from .records import load
from .report import collect, paired_difference


def paired(records, task: str, a: str, b: str, budget, metric: str, model: str | None = None) -> Interval:
    """Policy ``a`` - policy ``b`` at ``budget`` (the full cache: at any budget) on ``task``'s
    ``metric``, paired by sample within one model. ``records``: load()'s dict or a list."""
    recs = list(records.values()) if isinstance(records, dict) else list(records)
    models = sorted({r["model"] for r in recs if r["task"] == task})
    if model is None and len(models) > 1:
        raise ValueError(
            f"the records hold {task} runs of several models ({', '.join(models)}); say which with --model."
        )
    if model is not None:
        if model not in models:
            raise ValueError(f"no {task} records of model {model!r}; the folder has: {', '.join(models) or 'none'}.")
        recs = [r for r in recs if r["model"] == model]
    cells = collect(recs)[task][metric]

    def cell(policy):
        name, at, own = policy.partition("@")
        if name.removeprefix("base.") == FULL:  # the full cache's records have no budget
            return (name, None)
        return (name, float(own) if at else budget)

    return paired_difference(cells, cell(a), cell(b))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the eval output folder (records.jsonl)")
    p.add_argument("--task", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--metric", required=True)
    p.add_argument("--model", default=None, help="the model whose records to pair (needed when there are several)")
    p.add_argument("--baseline", default=None, help="a second run's folder, its policies named base.NAME")
    p.add_argument("pairs", nargs="+", help="A:B pairs of policy names (NAME@BUDGET: that cell at its own budget)")
    args = p.parse_args(argv)
    records = list(load(args.out).values())
    if args.baseline:
        base = list(load(args.baseline).values())
        if not base:
            p.error(f"no records in --baseline {args.baseline}")
        records += [dict(r, policy=f"base.{r['policy']}") for r in base]
    known = sorted({r["policy"] for r in records if r["task"] == args.task})
    if not known:
        p.error(f"no records of task {args.task!r} in {args.out}")
    for pair in args.pairs:
        a, sep, b = pair.partition(":")
        if not sep:
            p.error(f"pairs are A:B, got {pair!r}")
        for side in (a, b):
            name, at, own = side.partition("@")
            if at and not _is_number(own):
                p.error(f"{side!r}: after @ comes the cell's budget as a number (e.g. {name}@0.2)")
            if name not in known:
                p.error(f"no {args.task} records of policy {name!r} in {args.out}; it has: {', '.join(known)}")
        try:
            ci = paired(records, args.task, a, b, args.budget, args.metric, args.model)
        except ValueError as err:
            p.error(str(err))
        if ci.n == 0:
            print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: no shared samples")
        elif ci.n == 1:
            print(f"{args.task} {args.metric} {a} - {b} @ {args.budget}: {ci.mean:+.4g} n=1")
        else:
            print(
                f"{args.task} {args.metric} {a} - {b} @ {args.budget}: {ci.mean:+.4g} "
                f"[{ci.lo:+.4g}, {ci.hi:+.4g}] n={ci.n}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
