"""kvevict generate: answer one prompt under a KV budget and report the memory held."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._common import add_model_args, check_policy_args, cli_budget, load_model_args, mib, policy_params, setup_threads

NAME = "generate"
HELP = "answer a prompt under a KV budget; print the answer and the KV bytes held vs a 16-bit stock cache"


def add_arguments(p):
    add_model_args(p)
    # like the server: short prompts stay whole, eviction starts past 1024 tokens per layer & KV head
    p.set_defaults(budget=None)  # 1024 unless --policy's spec names one
    # no --policy: h2o, or with --memory the policy the budget picks (kvzip-pool: the prompt is known)
    p.set_defaults(policy=None)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="file with the prompt text ('-' for stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text as is")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args):
    from ..generate import generate

    if args.prompt_file:
        path = args.prompt_file
        if path != "-" and not Path(path).is_file():
            raise ValueError(f"prompt file {path!r} does not exist.")
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    else:
        text = args.prompt
    if not text.strip():
        raise ValueError("the prompt is empty.")
    check_policy_args(args)
    setup_threads(args)
    model, tok = load_model_args(args)
    prompt = text if args.raw else [{"role": "user", "content": text}]
    res = generate(
        model,
        tok,
        prompt,
        args.policy,
        cli_budget(args, "1024"),
        args.max_new_tokens,
        prefill_mode=args.prefill,
        stride=args.stride,
        **policy_params(args),
    )
    if args.json:
        print(json.dumps(res.as_dict()))
        return 0
    print(res.text)
    ratio = res.kv_bytes / res.full_kv_bytes if res.full_kv_bytes else 1.0
    stored = f", {res.storage}" if res.storage else ""
    print(
        f"\n[{res.policy} budget={res.budget}{stored}] prompt {res.prompt_tokens} tokens, {res.new_tokens} new, "
        f"{res.seconds:.2f} s; KV held {mib(res.kv_bytes)} vs 16-bit stock cache {mib(res.full_kv_bytes)} "
        f"({ratio:.0%})",
        file=sys.stderr,
    )
    return 0
