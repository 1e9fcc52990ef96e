"""kvevict lm-eval: lm-evaluation-harness with ``--model kvevict`` registered (extras kvevict[lmeval])."""

from __future__ import annotations

import argparse

NAME = "lm-eval"
HELP = (
    "run lm-evaluation-harness with --model kvevict registered; every lm-eval argument is passed on "
    "(--model_args pretrained=smollm2-135m,policy=h2o,memory=0.2 --tasks ...)"
)
PASSTHROUGH = True  # cli.main hands the raw arguments to run_argv: lm-eval parses them itself


def add_arguments(p):
    p.add_argument("rest", nargs=argparse.REMAINDER, help="lm-eval's arguments")


def run_argv(argv: list[str]) -> int:
    from ..lmeval.cli import main

    return main(argv)


def run(args):
    return run_argv(args.rest)
