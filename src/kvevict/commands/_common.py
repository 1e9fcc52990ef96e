"""Arguments several subcommands share."""

from __future__ import annotations

import os


def parse_budget(text: str):
    """'0.2' -> 0.2 (fraction of the prompt), '512' -> 512 (tokens)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"budget must be an int (tokens) or a float in (0, 1], got {text!r}.") from None


def add_model_args(p, policy=True):
    p.add_argument("--model", default="smollm2-135m", help="known name (smollm2-135m) or local HF folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    if policy:
        p.add_argument("--policy", default="h2o", help="eviction policy, or 'full' for the stock full cache")
        p.add_argument("--budget", default="0.2", help="tokens kept per layer and KV head (int) or fraction of the prompt")
        p.add_argument("--recent", type=int, default=None, help="recent window (default: half the budget)")


def setup_threads(args) -> None:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
