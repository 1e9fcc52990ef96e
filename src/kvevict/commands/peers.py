"""kvevict peers: create the peers' environments (kvpress, vLLM's CPU build, llama.cpp) in a folder
of your choosing, or say where each one is found."""

from __future__ import annotations

import sys
from pathlib import Path

NAME = "peers"
HELP = "create the peers' environments (kvpress, vLLM CPU, llama.cpp) in a folder, or show where they are"


def add_arguments(p):
    sub = p.add_subparsers(dest="peers_command", required=True)
    s = sub.add_parser("setup", help="create the environments (each step skipped when its output exists)")
    s.add_argument(
        "--into",
        default=None,
        help="root folder (default $KVEVICT_PEERS, else ~/.cache/kvevict/peers); export "
        "KVEVICT_PEERS=DIR afterwards so kvevict finds them",
    )
    s.add_argument("--only", default=None, help="comma list of kvpress,vllm,llamacpp (default all)")
    s.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp (default 2)")
    s.add_argument("--cpu-flags", default="avx512", help="llama.cpp CPU flags: avx512 (default) or avx2")
    s.add_argument("--python", default=sys.executable, help="interpreter that creates the venvs (default this one)")
    s.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    sub.add_parser("where", help="print where each peer is found (or how to create it)")


def run(args):
    from ..peers import locations
    from ..peers.environments import parse_only, plan, run_steps

    if args.peers_command == "where":
        for peer in locations.PEERS:
            found = locations.find(peer)
            print(f"{peer:9} {found if found else 'missing: ' + locations.hint(peer)}")
        return 0
    root = Path(args.into).expanduser().resolve() if args.into else locations.peers_root()
    steps = plan(root, parse_only(args.only), jobs=args.jobs, cpu_flags=args.cpu_flags, python=args.python)
    try:
        run_steps(steps, dry_run=args.dry_run, log=lambda m: print(m, flush=True))
    except RuntimeError as err:
        print(f"kvevict peers: {err}", file=sys.stderr)
        return 1
    if not args.dry_run and root != locations.peers_root():
        print(f"done: export {locations.ROOT_ENV}={root} so kvevict finds them")
    return 0
