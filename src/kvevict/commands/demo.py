"""kvevict demo: a pass key hidden in a long essay, answered by the full cache, by plain H2O and by
kvevict's recommended cache at the same share of a 16-bit stock cache's bytes (``kvevict.stock``)."""

from __future__ import annotations

from ._common import add_model_args, load_model_args, mib, setup_threads

NAME = "demo"
HELP = (
    "passkey in a long Paul Graham essay: full cache vs plain H2O vs the recommended cache at the same "
    "memory; answers, KV memory and time side by side"
)


def add_arguments(p):
    add_model_args(p, policy=False)
    p.add_argument("--tokens", type=int, default=1000, help="haystack length in tokens")
    p.add_argument("--depth", type=float, default=0.5, help="where the key hides (0 = start, 1 = end)")
    p.add_argument(
        "--memory",
        default="0.2",
        help="share of a 16-bit stock cache's bytes both budgeted caches may hold (0.2, 20%%)",
    )


def run(args):
    from ..data.essays import haystack
    from ..data.passkey import for_tokenizer, passkey_prompt
    from ..generate import generate
    from ..memory import parse_memory
    from ..policies import POLICIES
    from ..shape import head_dim_of
    from ..stock import STOCK_BYTES
    from ..storage import Storage, stat_bytes

    memory = parse_memory(args.memory)
    if not isinstance(memory, float):
        raise ValueError("the demo compares at a share of a 16-bit stock cache's bytes: give --memory as 0.2 or 20%.")
    threads = setup_threads(args)
    model, tok = load_model_args(args)
    build_kernel(model)
    task = passkey_prompt(haystack(tok, args.tokens), args.depth, seed=args.tokens)
    # plain H2O at the same bytes: tokens in the model's dtype, each slot with its bookkeeping
    d = head_dim_of(model)
    share = (
        memory
        * 2
        * d
        * STOCK_BYTES
        / Storage().slot_bytes(d, d, model.dtype.itemsize, stat_bytes(POLICIES["h2o"].stats))
    )
    runs = [
        ("full cache (stock)", dict(policy="full")),
        ("plain H2O", dict(policy="h2o", budget=share)),
        ("kvevict recommended", dict(memory=memory)),
    ]  # the budget picks the policy too
    rows = []
    for name, kw in runs:
        r = generate(model, tok, for_tokenizer(task.messages, task.lead, tok), max_new_tokens=16, **kw)
        label = f"{name}: {r.policy}, {r.storage}" if r.storage else name
        rows.append(
            (
                label,
                r.text,
                "yes" if task.answer in r.text else "no",
                f"{mib(r.kv_bytes)} ({r.kv_bytes / r.full_kv_bytes:.0%})",
                f"{r.seconds:.2f} s",
            )
        )
    print(
        f"pass key {task.answer} hidden at depth {args.depth:.0%} of a {r.prompt_tokens}-token prompt; "
        f"budgeted caches get {memory:.0%} of a 16-bit stock cache's bytes "
        f"({args.model}, {threads} thread{'' if threads == 1 else 's'})\n"
    )
    head = ("cache", "answer", "found", "KV held (of 16-bit stock)", "time")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    return 0


def build_kernel(model) -> None:
    """Build the compiled CPU decode kernel before the timed runs, so the time column is each
    cache's own (the build is once per environment; in a run it would be counted as the first
    budgeted cache's). Without a compiler it says so and the torch reference runs, as it would anyway."""
    import os
    import time

    from ..kernels import ENV, cpu, resolve_backend

    device = model.device.type
    if device == "cpu" and os.environ.get(ENV, "auto").lower() in ("auto", "cpu") and not cpu.built():
        print("building the CPU decode kernel (once per environment)...", end=" ", flush=True)
        start = time.perf_counter()
        ok, why = cpu.available()
        print(
            f"done in {time.perf_counter() - start:.0f} s"
            if ok
            else f"it cannot be built here ({why}); the torch reference runs",
            flush=True,
        )
    resolve_backend(device)  # loads a module built earlier: that too stays out of the timed runs
