"""kvevict sweep: a passkey-retrieval grid (policies x budgets x lengths x depths) through the grid
executor: local worker processes by default, a Ray cluster with --ray."""

from __future__ import annotations

from collections import defaultdict

from ..distributed.cli import add_executor_args, executor_spec
from ._common import number_list, parse_budget

NAME = "sweep"
HELP = "passkey retrieval over policies x budgets x lengths x depths, on local workers or a Ray cluster (--ray)"


def add_arguments(p):
    p.add_argument("--model", default="smollm2-135m", help="known name (smollm2-135m, gemma3-270m) or local HF folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--policies", default="full,h2o,recency", help="comma-separated; 'full' = the stock cache")
    p.add_argument("--budgets", default="0.2", help="comma-separated budgets (fractions or token counts)")
    p.add_argument("--tokens", default="500", help="comma-separated haystack lengths in tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--haystack", default="essays", choices=["essays", "filler"])
    p.add_argument("--out", default="runs/sweep.jsonl", help="JSONL of records; a re-run resumes it")
    add_executor_args(p)


def _items(args):
    policies = [p.strip().lower() for p in args.policies.split(",") if p.strip()]
    budgets = [parse_budget(b) for b in args.budgets.split(",") if b.strip()]
    tokens = number_list(args.tokens, "--tokens", int)
    depths = number_list(args.depths, "--depths")
    if not (policies and budgets and tokens and depths):
        raise ValueError("--policies, --budgets, --tokens and --depths each need at least one value.")
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must be in [0, 1], got {depths}.")
    from ..budget import check_budget
    from ..policies import POLICIES

    for b in budgets:  # before any worker loads the model
        check_budget(b)

    unknown = [p for p in policies if p not in POLICIES and p != "full"]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: full, {', '.join(sorted(POLICIES))}.")
    for policy in policies:
        for budget in [None] if policy == "full" else budgets:
            for n in tokens:
                for depth in depths:
                    yield {
                        "task": "passkey",
                        "model": args.model,
                        "haystack": args.haystack,
                        "policy": policy,
                        "budget": budget,
                        "tokens": n,
                        "depth": depth,
                        "seed": n * 1000 + round(depth * 100),
                    }  # a different key per cell, the same per policy


def run(args):
    from ..distributed import item_key, read_records, run_grid

    items = list(_items(args))
    spec = executor_spec(args)
    summary = run_grid(
        items,
        "kvevict.distributed.passkey_task:run",
        args.model,
        args.out,
        executor=spec,
        workers=args.workers,
        threads=args.threads,
    )
    wanted = {item_key(it) for it in items}
    rows = defaultdict(list)
    for r in read_records(args.out):
        if r.get("grid_key") in wanted:
            rows[(r["policy"], r["budget"])].append(r)
    where = "a local Ray" if spec == "ray:" else ("Ray at " + spec[4:] if spec.startswith("ray:") else spec)
    print(
        f"{len(items)} items: {summary.done} run now ({where}), {summary.skipped} already in {args.out}, "
        f"{len(summary.failed)} failed"
    )
    print(f"{'policy':<10} {'budget':>7} {'n':>3} {'found':>6} {'of 16-bit stock':>15} {'s/item':>7}")
    for (policy, budget), rs in sorted(rows.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], str(kv[0][1]))):
        found = sum(r["found"] for r in rs) / len(rs)
        ratio = sum(r["kv_bytes"] for r in rs) / max(1, sum(r["full_kv_bytes"] for r in rs))
        secs = sum(r["seconds"] for r in rs) / len(rs)
        print(
            f"{policy:<10} {str(budget if budget is not None else '-'):>7} {len(rs):>3} {found:>6.0%} "
            f"{ratio:>15.0%} {secs:>7.2f}"
        )
    for key, err in list(summary.failed.items())[:3]:
        print(f"failed: {key}\n  {err.splitlines()[0]}")
    return 1 if summary.failed else 0
