"""``kvevict`` command line: each subcommand is a module of kvevict.commands with NAME, HELP,
add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands

# commands that left the installed CLI -> where they went
MOVED = {
    "bench": "the benchmarks live in the kvevict repository, outside the installed package: from a "
    "checkout run `python benchmarks/bench.py ARGS` (the arguments `kvevict bench` took; "
    "--help lists them)."
}


def _modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{commands.__name__}.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvevict", description="Generate under a fixed KV-cache budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in _modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MOVED:
        print(f"kvevict {argv[0]}: {MOVED[argv[0]]}", file=sys.stderr)
        return 2
    wrapped = {m.NAME: m for m in _modules() if getattr(m, "PASSTHROUGH", False)}
    if argv and argv[0] in wrapped:  # a wrapped command line (lm-eval) parses its own arguments
        return wrapped[argv[0]].run_argv(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._run(args) or 0
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"kvevict {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
