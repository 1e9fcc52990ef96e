"""kvevict inspect: the attention observatory on one text."""

from __future__ import annotations

from pathlib import Path

from ._common import add_model_args, load_model_args, parse_budget, setup_threads

NAME = "inspect"
HELP = (
    "attention observatory: sparsity per layer, power-law accumulated attention, heavy-hitter "
    "stability, settling attention std; plots + an HTML page of what a policy kept"
)


def add_arguments(p):
    add_model_args(p, policy=False)
    p.add_argument("--text", required=True, help="text file to observe")
    p.add_argument("--out", default="results/inspect", help="output folder")
    p.add_argument("--tokens", type=int, default=2048, help="observe the first N tokens of the text")
    p.add_argument("--policy", default="h2o", help="policy for the kept/evicted page")
    p.add_argument("--budget", default="0.2", help="its budget: fraction of the text, or tokens")


def run(args):
    from ..budget import check_budget
    from ..policies import make_policy

    path = Path(args.text)
    if not path.is_file():
        raise ValueError(f"text file {args.text!r} does not exist.")
    make_policy(args.policy)  # unknown names: ValueError listing the known ones
    budget = parse_budget(args.budget)
    check_budget(budget)
    if args.tokens < 16:
        raise ValueError(f"--tokens must be >= 16, got {args.tokens}.")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {args.text!r} is empty.")
    from ..observatory.report import inspect_text

    setup_threads(args)
    model, tok = load_model_args(args)
    r = inspect_text(model, tok, text, args.out, args.policy, budget, args.tokens)
    print((Path(args.out) / "summary.md").read_text())
    return 0 if r else 1
