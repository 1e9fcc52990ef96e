"""The executor flags a grid command shares (eval, bench, sweep): ``--ray ADDRESS|auto``, ``--workers``."""

from __future__ import annotations


def add_executor_args(p) -> None:
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the grid on a Ray cluster: 'auto' (the running one), 'local' (start one here) "
        "or an address such as ray://head:10001 (needs kvevict[ray])",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes / Ray actors, each holding one model (default: 1 local, 1 per CPU on Ray)",
    )
    p.add_argument("--inline", action="store_true", help="run in this process (no worker processes)")


def executor_spec(args) -> str:
    """The executor spec ``run_grid`` takes, from the flags above."""
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}.")
    if args.ray and args.inline:
        raise ValueError("--ray and --inline exclude each other.")
    if args.ray:
        return "ray:" + ("" if args.ray == "local" else args.ray)
    return "inline" if args.inline else "local"
