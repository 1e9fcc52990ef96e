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
    from ..data.passkey import passkey_prompt
    from ..generate import encode_chat, generate
    from ..memory import MIN_TOKENS, parse_memory

    memory = parse_memory(args.memory)
    if not isinstance(memory, float):
        raise ValueError("the demo compares at a share of a 16-bit stock cache's bytes: give --memory as 0.2 or 20%.")
    threads = setup_threads(args)
    model, tok = load_model_args(args)
    build_kernel(model)
    task = passkey_prompt(haystack(tok, args.tokens), args.depth, seed=args.tokens)
    prompt = demo_prompt(task, tok)
    rows, over = [], False
    for name, kw in budgeted_runs(model, memory, encode_chat(tok, prompt).shape[-1]):
        r = generate(model, tok, prompt, max_new_tokens=16, **kw)
        label = f"{name}: {r.policy}, {r.storage}" if r.storage else name
        answer = " ".join(r.text.split())  # a base model's newlines would break the table's rows
        share = r.kv_bytes / r.full_kv_bytes
        over = over or (r.storage != "" and share > memory)
        found = "yes" if task.answer in r.text else "no"
        rows.append((label, answer, found, f"{mib(r.kv_bytes)} ({share:.1%})", f"{r.seconds:.2f} s"))
    form = "a chat" if getattr(tok, "chat_template", None) else f'text ending "{task.lead}"'
    print(
        f"pass key {task.answer} hidden at depth {args.depth:.0%} of a {r.prompt_tokens}-token prompt "
        f"({form}); budgeted caches get {memory:.0%} of a 16-bit stock cache's bytes "
        f"({args.model}, {threads} thread{'' if threads == 1 else 's'})\n"
    )
    head = ("cache", "answer", "found", "KV held (of 16-bit stock)", "time")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    if over:  # the memory plan's floor (kvevict.memory.MIN_TOKENS) keeps a short prompt's tokens
        print(
            f"\nA budgeted cache held more than {memory:.0%}: a memory budget keeps at least {MIN_TOKENS} "
            "tokens per layer and KV head, more than this share of this prompt buys. Give more --tokens or --memory."
        )
    return 0


def demo_prompt(task, tokenizer):
    """The question as a chat for a chat model; for a base model (no chat template) the text with
    the key and the answer's first words to complete ("... The pass key is", Mohtashami & Jaggi's
    form), without the question around it: Gemma 3 270M, a base model, goes on with the question's
    own words ("hidden in the following text") after it, full cache included."""
    if getattr(tokenizer, "chat_template", None):
        return task.messages
    return f"{task.text}\n\n{task.lead}"


def budgeted_runs(model, memory: float, prompt_tokens: int) -> list[tuple[str, dict]]:
    """(name, ``generate`` arguments) of the demo's three caches: the stock full cache, plain H2O
    holding at most ``memory`` of a 16-bit stock cache's bytes (``h2o_tokens``), and kvevict's
    recommended cache at that memory (the budget picks the policy and the storage too)."""
    h2o = dict(policy="h2o", budget=h2o_tokens(model, memory, prompt_tokens))
    if model.dtype.itemsize != 2:  # plain H2O keeps 16-bit tokens, as the stock cache it is stated against
        h2o["kv_bits"] = 16
    return [
        ("full cache (stock)", dict(policy="full")),
        ("plain H2O", h2o),
        ("kvevict recommended", dict(memory=memory)),
    ]


def h2o_tokens(model, memory: float, n: int) -> int:
    """Plain H2O's tokens per layer and KV head for an n-token prompt: the largest B with
    sum_l min(B, kept_l) x slot <= memory x sum_l kept_l x token, where kept_l is what a stock cache
    keeps of layer l (n, or on a sliding layer its window: ``kvevict.stock``), a token is 16-bit keys
    and values, and a slot one with H2O's position and statistics (``Storage.slot_bytes``). A
    budget taken as a share of the prompt's tokens would give Gemma 3's sliding layers, which the
    stock cache holds at 511 tokens, the global layers' share of every token."""
    from bisect import bisect_right

    from ..policies import POLICIES
    from ..shape import head_dim_of
    from ..stock import STOCK_BYTES, kept_tokens, stock_windows
    from ..storage import Storage, stat_bytes

    d = head_dim_of(model)
    slot = Storage(kv_bits=16).slot_bytes(d, d, 2, stat_bytes(POLICIES["h2o"].stats))
    windows = stock_windows(model.config)
    room = memory * kept_tokens(windows, n) * 2 * d * STOCK_BYTES / slot  # slots over all layers
    caps = [n if w is None else min(n, w) for w in windows]
    held = bisect_right(range(1, n + 1), room, key=lambda b: sum(min(b, c) for c in caps))
    return max(1, held)


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
