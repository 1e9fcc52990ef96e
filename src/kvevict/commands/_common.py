"""Arguments several subcommands share."""

from __future__ import annotations

import os

DTYPES = ("float32", "bfloat16", "float16")


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


def number_list(text: str, flag: str, kind=float) -> list:
    """'1024,2048' -> [1024, 2048] (``kind`` int or float); a bad item is a ValueError naming ``flag``."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ValueError(f"{flag} takes comma-separated {what}, got {text!r}.") from None


def add_model_args(p, policy=True, prefill=True):
    """--model, --threads; with ``policy`` --policy/--budget/--recent, and with ``prefill`` too the
    per-run options (--prefill, --stride, --compact, --param) that only single runs honour."""
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="known name (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b), local HF folder, or a .gguf file "
        "(converted once and cached, as the known models are)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="the model's weights and activations (bfloat16: about 2x faster prefill on a CPU with "
        "AVX-512 BF16 or AMX, about 5x slower on one without; kvevict warns there)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: $OMP_NUM_THREADS, else half the cores; all cores stall "
        "when another process is busy)",
    )
    if policy:
        p.add_argument("--policy", default="h2o", help="eviction policy, or 'full' for the stock full cache")
        p.add_argument(
            "--budget",
            default=None,
            help="tokens kept per layer and KV head (int) or fraction of the prompt (default 0.2)",
        )
        p.add_argument("--recent", type=int, default=None, help="recent window (default: the policy's own)")
    if policy and prefill:
        p.add_argument(
            "--prefill",
            default="full",
            choices=["full", "token", "block"],
            help="how the prompt enters the cache (block: chunks of --stride tokens)",
        )
        p.add_argument("--stride", type=int, default=None, help="block prefill chunk size in tokens")
        p.add_argument(
            "--compact",
            action="store_true",
            help="compact positions (StreamingLLM re-rotation): go on past the context length",
        )
        p.add_argument(
            "--param",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="a policy parameter, e.g. --param sinks=4 --param window=32 (repeatable)",
        )
        p.add_argument(
            "--memory",
            default=None,
            help="a budget in bytes instead of --budget: share of a 16-bit stock cache (0.2, 20%%) "
            "or size (64MiB); kvevict picks tokens kept x bits, and the policy unless --policy "
            "names one (see docs/guide.md)",
        )
        p.add_argument("--kv-bits", type=int, default=None, help="store kept tokens in 16, 8, 4 or 2 bits")
        p.add_argument(
            "--evicted-bits",
            type=int,
            default=None,
            help="demote evicted tokens to a tier of 16, 8, 4 or 2 bits instead of dropping them",
        )


def policy_params(args) -> dict:
    """--recent and --param NAME=VALUE as keyword arguments for make_cache."""
    out = {} if args.recent is None else {"recent": args.recent}
    if getattr(args, "compact", False):
        out["compact"] = True
    for name in ("memory", "kv_bits", "evicted_bits"):
        if getattr(args, name, None) is not None:
            out[name] = args.__dict__[name]
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--param takes NAME=VALUE, got {item!r}.")
        try:
            out[name] = int(value)
        except ValueError:
            try:
                out[name] = float(value)
            except ValueError:
                out[name] = value
    return out


def cli_budget(args, default: str):
    """--budget as generate() takes it: None where --policy's spec names its own budget."""
    from ..spec import CacheSpec

    if args.policy and CacheSpec.parse(args.policy).budget is not None:
        return None
    return parse_budget(args.budget if args.budget is not None else default)


def check_policy_args(args) -> None:
    """Fail on a bad policy, budget or prefill before the model takes seconds to load. --policy is a
    cache spec (``kvevict.spec``: ``h2o``, ``snapkv+q/int8@0.2``, ``kvzip-pool@memory=0.1``)."""
    from ..budget import check_budget
    from ..prefill import check_mode
    from ..spec import FULL, CacheSpec

    spec = CacheSpec.parse(args.policy) if args.policy else None
    if spec is not None and spec.budget is not None and (args.budget is not None or args.memory is not None):
        raise ValueError(f"--policy {args.policy} names its budget already: drop --budget / --memory, or the @ part.")
    if args.budget is not None and (spec is None or spec.policy != FULL):
        check_budget(parse_budget(args.budget))
    check_mode(args.prefill, args.stride)
    if getattr(args, "memory", None) is not None:
        from ..memory import parse_memory

        parse_memory(args.memory)
    if getattr(args, "kv_bits", None) is not None or getattr(args, "evicted_bits", None) is not None:
        from ..storage import Storage

        Storage(kv_bits=args.kv_bits, evicted_bits=args.evicted_bits)


def output_folder(text: str, flag: str = "--out"):
    """The folder ``text``, created if missing; a file in the way is a ValueError naming ``flag``."""
    from pathlib import Path

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {text!r} is a file; give a folder (it is created if missing).")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {text!r}: cannot create the folder ({err.strerror}); give another.") from None
    return path


def default_threads() -> int:
    """Torch threads when --threads is not given: $OMP_NUM_THREADS if set, else half the cores this
    process may run on (at least 1). Why not torch's default (every core): its threads spin at each
    parallel region's barrier, so while another busy process holds a core every barrier waits for a
    descheduled thread, and a decode step gets 4-60x slower (docs/results/performance.md, "Threads").
    Half the cores leaves room for one neighbour and costs at most 2x on an idle machine."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // 2)


def setup_threads(args) -> int:
    """Set torch's threads from --threads or ``default_threads()``; returns the number set."""
    import torch

    threads = default_threads() if args.threads is None else args.threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads!r}.")
    torch.set_num_threads(threads)
    return threads


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def load_model_args(args):
    """(model, tokenizer) for --model in --dtype."""
    import torch

    from ..models import load_model

    return load_model(args.model, dtype=getattr(torch, getattr(args, "dtype", None) or "float32"))
