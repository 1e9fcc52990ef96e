"""kvevict serve: an OpenAI-compatible HTTP server with per-request KV policies and budgets."""

from __future__ import annotations

import os
import re
import sys

from ._common import add_model_args, parse_budget, setup_threads

NAME = "serve"
HELP = "OpenAI-compatible server (/v1/chat/completions, /v1/completions) with per-request kv_policy / kv_budget"


def add_arguments(p):
    add_model_args(p, prefill=False)  # requests choose kv_policy / kv_budget / kv_recent, nothing else
    p.set_defaults(budget="auto")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", default=None, help="model id clients ask for (default: --model)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=256,
        help="most sequences running at once (how many fit "
        "is --kv-memory's to say: a short chat holds only its own pages)",
    )
    p.add_argument(
        "--budget-share",
        type=int,
        default=16,
        help="the default budget is the share of "
        "--kv-memory that this many sequences (at most --max-batch) can hold at once",
    )
    p.add_argument(
        "--kv-memory",
        default="2GiB",
        metavar="SIZE",
        help="K/V bytes the server may hold (e.g. 512MiB, 2GiB); requests that do not fit wait. "
        "The default --budget 'auto' gives each sequence kv-memory / min(max-batch, budget-share)",
    )
    p.add_argument("--min-budget", type=int, default=64, help="a fractional kv_budget keeps at least this many tokens")
    p.add_argument(
        "--budget-round",
        type=int,
        default=1,
        help="round a fractional budget's token count up to a multiple of this, so that prompts of "
        "similar length share a batch (1 = exact)",
    )
    p.add_argument(
        "--kv-bits",
        default=None,
        help="bits per key/value channel of budgeted rows: 16, 8 or 4, or 'none' for the model's "
        "dtype (default 8: at the same --kv-memory, more rows and tokens at the same quality)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens when a request gives none")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="the most max_tokens a request may ask")
    add_access_arguments(p)
    add_prefix_cache_arguments(p)
    p.add_argument("--replicas", type=int, default=1, help="N > 1: N replicas under Ray Serve (needs kvevict[ray])")
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="with --replicas: Ray cluster address or 'auto' (default: start a local Ray)",
    )


def add_access_arguments(p):
    """Who may ask (API keys), how many may wait, and how long a request and a drain may take."""
    p.add_argument(
        "--api-key",
        default=None,
        action="append",
        help="every /v1 route asks for 'Authorization: Bearer KEY' "
        "(401 otherwise); default $KVEVICT_API_KEY (several: comma-separated), else none (open). "
        "/health stays open. Give it several times for several keys: each key's stored prompt "
        "prefixes serve its own requests only",
    )
    p.add_argument("--protect-metrics", action="store_true", help="/metrics asks for the --api-key too")
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests that may wait for memory or a slot; past it a request gets 429 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a request not done this long after it arrived (504; its memory freed). Default: none",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM: new requests get 503 and those in flight get this long to finish, then the server exits 0",
    )


def add_prefix_cache_arguments(p):
    p.add_argument(
        "--prefix-cache-memory",
        default="0",
        metavar="SIZE",
        help="bytes of K/V (part of --kv-memory) that stored prompt prefixes may hold: a chat request "
        "whose prompt begins with one prefills only the rest, and stores its own earlier turns for the "
        "next (e.g. 512MiB; default 0: off)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="no prompt prefixes are stored or reused")
    p.add_argument(
        "--prefix-cache-shared-across-keys",
        action="store_true",
        help="with several --api-key: one key's stored prefixes serve every key's requests (default: its own only)",
    )


def settings_from_args(args) -> dict:
    from ..budget import check_budget
    from ..spec import CacheSpec

    budget = None if args.budget == "auto" else parse_budget(args.budget)
    try:
        spec = CacheSpec.parse(args.policy)  # NAME[/BITS][@BUDGET]: the rows' default cache
    except ValueError as err:
        raise ValueError(f"--policy {args.policy!r}: {err}") from None
    if spec.memory or spec.question:
        raise ValueError(
            f"--policy {args.policy}: the server's memory is --kv-memory and a request has no "
            "question to protect; give a policy, its storage and a token budget (h2o/int8@0.2)."
        )
    if spec.budget is not None:
        if budget is not None:
            raise ValueError(f"--policy {args.policy} names its budget already: drop --budget or the @ part.")
        budget = spec.budget
    if spec.storage is not None and spec.policy != "full":
        if args.kv_bits is not None:
            raise ValueError(f"--policy {args.policy} names its storage already: drop --kv-bits or the / part.")
        if spec.storage.evicted_bits is not None:
            raise ValueError("the server keeps one tier per row: name kept bits only (h2o/int8).")
        args.kv_bits = "none" if spec.storage.kv_bits is None else str(spec.storage.kv_bits)
    policy = spec.policy

    if budget is not None:
        check_budget(budget)
    storage = {}  # --kv-bits not given: the server's default (Settings.kv_bits)
    if args.kv_bits is not None:
        if policy == "full":
            raise ValueError(
                "--kv-bits sets the storage of budgeted rows; --policy full keeps the stock cache "
                "in the model's dtype: drop --kv-bits or name a policy."
            )
        storage["kv_bits"] = parse_kv_bits(args.kv_bits)
    for name in (
        "max_batch",
        "budget_share",
        "max_tokens",
        "max_tokens_limit",
        "replicas",
        "budget_round",
        "min_budget",
        "max_queue",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    kv_memory, hosting = parse_bytes(args.kv_memory), hosting_from_args(args)
    return dict(
        model_id=args.served_name or args.model,
        policy=policy,
        budget=budget,
        recent=args.recent,
        max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_batch=args.max_batch,
        budget_share=args.budget_share,
        kv_memory=kv_memory,
        min_budget=args.min_budget,
        budget_round=args.budget_round,
        **storage,
        **hosting,
        **prefix_cache_from_args(args, kv_memory, hosting["api_key"]),
    )


def prefix_cache_from_args(args, kv_memory: int, api_key) -> dict:
    """--prefix-cache-memory (0 or --no-prefix-cache: off), --prefix-cache-shared-across-keys."""
    flag = "--prefix-cache-memory"
    off = args.no_prefix_cache or args.prefix_cache_memory.strip().lower() in ("0", "off", "none")
    if args.no_prefix_cache and args.prefix_cache_memory.strip() != "0":
        raise ValueError(f"--no-prefix-cache turns the prefix store off: drop {flag} or --no-prefix-cache.")
    memory = 0 if off else parse_bytes(args.prefix_cache_memory, flag)
    if memory >= kv_memory:
        raise ValueError(
            f"{flag} ({memory} bytes) is the part of --kv-memory ({kv_memory} bytes) stored prefixes may "
            "hold: give less than --kv-memory."
        )
    if args.prefix_cache_shared_across_keys and (not memory or not api_key):
        raise ValueError(
            "--prefix-cache-shared-across-keys lets one API key's stored prefixes serve another's: it needs "
            f"{flag} and --api-key (without keys every request shares the store already)."
        )
    return dict(prefix_cache_memory=memory, prefix_cache_shared=args.prefix_cache_shared_across_keys)


def hosting_from_args(args) -> dict:
    """--api-key (or $KVEVICT_API_KEY), --protect-metrics, --max-queue, --request-timeout; --drain-timeout checked."""
    keys = args.api_key
    if keys is None and os.environ.get("KVEVICT_API_KEY") is not None:
        keys = os.environ["KVEVICT_API_KEY"].split(",")
    if isinstance(keys, str):
        keys = [keys]
    for k in keys or ():
        if not k.strip() or k != k.strip():
            raise ValueError("--api-key / KVEVICT_API_KEY must be a non-empty key without surrounding spaces.")
    key = None if not keys else keys[0] if len(keys) == 1 else tuple(dict.fromkeys(keys))
    if args.protect_metrics and not key:
        raise ValueError("--protect-metrics keys /metrics with the API key: give --api-key (or KVEVICT_API_KEY).")
    for name in ("request_timeout", "drain_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}.")
    return dict(
        api_key=key,
        protect_metrics=args.protect_metrics,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
    )


def parse_kv_bits(text: str) -> int | None:
    """'8' -> 8, 'none' -> None (the model's dtype); anything else a ValueError that lists the choices."""
    from ..storage import check_bits

    if text.strip().lower() in ("none", "fp", "dtype"):
        return None
    bits = int(text) if text.strip().isdigit() else text
    check_bits(bits, "--kv-bits")
    return bits


UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '1048576' -> 1048576."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) * UNITS[m.group(2).lower()] < 1:
        raise ValueError(f"{flag} takes a size such as 512MiB or 2GiB, got {text!r}.")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def run(args):
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("kvevict serve needs the serve extra: pip install 'kvevict[serve]'.") from None
    settings = settings_from_args(args)
    if args.replicas > 1 or args.ray:
        from ..serve.replicas import serve_replicas

        return serve_replicas(args.model, settings, args.replicas, args.host, args.port, args.ray, args.threads)
    from ..serve.drain import serve
    from ..serve.server import build
    from ..storage import Storage

    app, engine = build(args.model, settings, setup_threads(args))
    print(
        f"kvevict: serving {settings['model_id']} on http://{args.host}:{args.port}/v1 "
        f"(default kv_policy={settings['policy']}, kv_budget={engine.settings.budget} tokens, "
        f"{Storage(kv_bits=engine.settings.kv_bits).label or 'model dtype'} storage, "
        f"kv_memory={settings['kv_memory']} bytes)",
        file=sys.stderr,
    )
    if not settings["api_key"] and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"kvevict: warning: {args.host} is reachable from other hosts and there is no --api-key: "
            "anyone who reaches the port can use the model",
            file=sys.stderr,
        )
    serve(app, engine, args.host, args.port, args.drain_timeout)
    return 0
