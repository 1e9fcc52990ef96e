"""kvevict demo: a pass key hidden in a long essay, answered by the full cache and by H2O."""

from __future__ import annotations

from ._common import add_model_args, mib, parse_budget, setup_threads

NAME = "demo"
HELP = "passkey in a long Paul Graham essay: full cache vs H2O, answers, KV memory and time side by side"


def add_arguments(p):
    add_model_args(p, policy=False)
    p.add_argument("--tokens", type=int, default=1000, help="haystack length in tokens")
    p.add_argument("--depth", type=float, default=0.5, help="where the key hides (0 = start, 1 = end)")
    p.add_argument("--budget", default="0.2")
    p.add_argument("--policies", default="full,h2o", help="comma-separated; 'full' is the stock cache")


def run(args):
    from ..data.essays import haystack
    from ..data.passkey import passkey_prompt
    from ..generate import generate
    from ..models import load_model

    setup_threads(args)
    model, tok = load_model(args.model)
    task = passkey_prompt(haystack(tok, args.tokens), args.depth, seed=args.tokens)
    budget = parse_budget(args.budget)
    rows = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        r = generate(model, tok, task.messages, policy, budget, max_new_tokens=16)
        rows.append((policy if policy == "full" else f"{policy} @ {budget}", r.text, task.answer in r.text,
                     mib(r.kv_bytes), f"{r.seconds:.2f} s"))
    print(f"pass key {task.answer} hidden at depth {args.depth:.0%} of a {r.prompt_tokens}-token prompt "
          f"({args.model}, {__import__('torch').get_num_threads()} threads)\n")
    head = ("cache", "answer", "found", "KV held", "time")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    return 0
