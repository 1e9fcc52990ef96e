"""Compress once, ask many, timed: one context with four hidden facts, four questions each asking
one, through ``kvevict.compress`` against a full recompute of context + question per question.

    python benchmarks/compress_ask.py --model smollm2-135m --threads 2 --tokens 4096 --rounds 5 \\
        --memory 0.2 --out results/compress_ask.json

The target: each question's time to first token through the compressed context (a fork,
``ctx.answer(q, max_new_tokens=1)``) at most 0.25x the stock cache's on the whole context + question
(``generate(..., policy="full", max_new_tokens=1)``), with answers no worse, question by question,
than compressing once per question (the question inside the prompt: ``generate(model, tok,
context + question, memory=...)``, or ``--cache``'s spec). All three read the very same tokens: the
context's ids as ``compress`` encodes them, then the question's.

A round times, for each question in a rotated order, the full recompute and the fork back to back
(one untimed warm-up call of each before the first round); each question's ratio is the median over
rounds of fork / full within a round. The compression is timed once a round (``ctx.seconds``) and
reported alone and spread over the questions. Answers (greedy, ``--max-new-tokens``) are read once
per arm, after the rounds. Prints a table and writes JSON (``--out``) with the command.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
from pathlib import Path

import torch

TARGET_RATIO = 0.25  # the target: a question's time to first token at most a quarter of a full recompute's
DEPTHS = (0.2, 0.4, 0.6, 0.8)  # where the four facts sit in the context


def build_facts(haystack: str, n_facts: int = 4, seed: int = 0, lead: bool = False) -> tuple[str, list[dict]]:
    """(the context, one dict per fact: label, value, depth, question). ``n_facts`` labelled 6-digit
    numbers (RULER's multi-key needle, ``kvevict.data.needles``) at spread depths; each question asks
    for one of them, so the other three are distractors. ``lead``: each question ends with the
    answer's first words, for a model without a chat template (``data.passkey.for_tokenizer``)."""
    from kvevict.data.needles import LABELS
    from kvevict.data.passkey import insert_at

    if not 1 <= n_facts <= len(DEPTHS):
        raise ValueError(f"n_facts must be in [1, {len(DEPTHS)}], got {n_facts}.")
    rng = random.Random(seed)
    labels = rng.sample(LABELS, n_facts)
    values = rng.sample(range(100000, 1000000), n_facts)  # distinct, so no answer counts for another
    facts = [{"label": lab, "value": str(val), "depth": d} for lab, val, d in zip(labels, values, DEPTHS[:n_facts])]
    text = haystack
    for f in sorted(facts, key=lambda f: -f["depth"]):  # deepest first: earlier cuts do not shift later ones
        text = insert_at(text, f["depth"], f" The special magic number for {f['label']} is {f['value']}. ")
    for f in facts:
        f["question"] = f"What is the special magic number for {f['label']}? Answer with the number only."
        if lead:
            f["question"] += f"\nThe special magic number for {f['label']} is"
    return "Some special magic numbers are hidden in the following text. Remember them.\n\n" + text, facts


def cache_kwargs(cache: str | None, memory: float) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of ``compress`` and ``generate`` for one cache: a spec
    (``--cache``, e.g. ``h2o/int4@0.2``, ``kvzip-pool@memory=0.1``), else ``memory=``."""
    if cache:
        return (cache,), {}
    if not 0 < memory <= 1:
        raise ValueError(f"--memory is a share of a 16-bit stock cache in (0, 1], got {memory}.")
    return (), {"memory": memory}


def found(text: str, value: str) -> bool:
    return value in text


def ratio_summary(full: list[float], fork: list[float]) -> dict:
    """Median seconds of each arm and the median over rounds of fork / full within a round."""
    if len(full) != len(fork) or not full:
        raise ValueError("full and fork need the same number of rounds, at least one.")
    return {
        "full_s": statistics.median(full),
        "fork_s": statistics.median(fork),
        "ratio": statistics.median(b / a for a, b in zip(full, fork)),
    }


@torch.no_grad()
def time_rounds(model, tok, ctx_args: tuple, ctx_kw: dict, context: str, facts: list[dict], rounds: int) -> dict:
    """Seconds of every arm, round by round: the compression, and per question the full recompute's
    and the fork's time to first token. Returns the last round's compressed context too."""
    from kvevict.compress import compress
    from kvevict.generate import generate

    ctx = compress(model, tok, context, *ctx_args, **ctx_kw)  # warm-up (the kernels' first build)
    ids = [torch.cat([ctx.ids, ctx.question_ids(f["question"])], 1) for f in facts]
    for i, f in enumerate(facts):
        generate(model, tok, ids[i], policy="full", max_new_tokens=1)
        ctx.answer(f["question"], max_new_tokens=1)
    out: dict = {"compress_s": [], "full_s": [[] for _ in facts], "fork_s": [[] for _ in facts]}
    for r in range(rounds):
        ctx = compress(model, tok, context, *ctx_args, **ctx_kw)
        out["compress_s"].append(ctx.seconds)
        for k in range(len(facts)):
            i = (k + r) % len(facts)  # rotate which question goes first
            out["full_s"][i].append(generate(model, tok, ids[i], policy="full", max_new_tokens=1).seconds)
            out["fork_s"][i].append(ctx.answer(facts[i]["question"], max_new_tokens=1).seconds)
    out["ctx"], out["ids"] = ctx, ids
    return out


@torch.no_grad()
def read_answers(model, tok, ctx, ids: list, ctx_args: tuple, ctx_kw: dict, facts: list[dict], max_new: int) -> list:
    """Each question's answer from the three arms: the full cache, the compressed context (asked
    once, then again to show it unchanged), and compressing once per question (question inside)."""
    from kvevict.generate import generate

    rows = []
    for f, q_ids in zip(facts, ids):
        full = generate(model, tok, q_ids, policy="full", max_new_tokens=max_new)
        once = ctx.answer(f["question"], max_new_tokens=max_new)
        per_q = generate(model, tok, q_ids, *ctx_args, max_new_tokens=max_new, **ctx_kw)
        rows.append(
            {
                "label": f["label"],
                "value": f["value"],
                "depth": f["depth"],
                "question_tokens": q_ids.shape[1] - ctx.length,
                "full": {"text": full.text, "found": found(full.text, f["value"])},
                "once": {"text": once.text, "found": found(once.text, f["value"]), "kv_bytes": once.kv_bytes},
                "per_question": {
                    "text": per_q.text,
                    "found": found(per_q.text, f["value"]),
                    "policy": per_q.policy,
                    "storage": per_q.storage,
                    "kv_bytes": per_q.kv_bytes,
                    "seconds": per_q.seconds,
                },
            }
        )
    return rows


def run(model, tok, context: str, facts: list[dict], cache: str | None, memory: float, rounds: int, max_new: int):
    """The whole measurement (see the module's doc) as a dict, ready for ``table`` and JSON."""
    from kvevict.generate import storage_label

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}.")
    ctx_args, ctx_kw = cache_kwargs(cache, memory)
    timed = time_rounds(model, tok, ctx_args, ctx_kw, context, facts, rounds)
    ctx = timed["ctx"]
    rows = read_answers(model, tok, ctx, timed["ids"], ctx_args, ctx_kw, facts, max_new)
    for i, row in enumerate(rows):
        row["ttft"] = ratio_summary(timed["full_s"][i], timed["fork_s"][i])
        row["ttft"]["rounds_full_s"], row["ttft"]["rounds_fork_s"] = timed["full_s"][i], timed["fork_s"][i]
    compress_s = statistics.median(timed["compress_s"])
    full_total = sum(r["ttft"]["full_s"] for r in rows)
    fork_total = sum(r["ttft"]["fork_s"] for r in rows)
    fast = all(r["ttft"]["ratio"] <= TARGET_RATIO for r in rows)
    no_worse = all(r["once"]["found"] >= r["per_question"]["found"] for r in rows)
    return {
        "context_tokens": ctx.length,
        "policy": ctx.label,
        "budget": str(ctx.budget),
        "storage": storage_label(ctx.cache),  # "int8+int4, 820 of 4100 tokens": kept tokens, their storage
        "kv_share": ctx.kv_bytes() / ctx.full_kv_bytes(),
        "compress_s": timed["compress_s"],
        "compress_median_s": compress_s,
        "amortized": {  # all four questions' first tokens, the compression included, against four full recomputes
            "per_question_s": (compress_s + fork_total) / len(rows),
            "ratio": (compress_s + fork_total) / full_total,
        },
        "rows": rows,
        "target": {"ratio": TARGET_RATIO, "ttft_met": fast, "answers_no_worse": no_worse, "met": fast and no_worse},
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def table(res: dict) -> str:
    """The result as markdown: one row per question, then the compression and the verdict."""
    lines = [
        f"{res['context_tokens']}-token context, {len(res['rows'])} questions; {res['model']} {res['dtype']}, "
        f"{res['threads']} threads, {res['rounds']} rounds (median); compressed: {res['policy']} "
        f"({res['storage']}; {res['kv_share']:.1%} of a 16-bit stock cache's bytes)\n",
        "| fact (depth) | full recompute TTFT ms | fork TTFT ms | fork / full | found: full | "
        "compress once | once per question |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        t = r["ttft"]
        lines.append(
            f"| {r['label']} ({r['depth']:g}) | {t['full_s'] * 1e3:.0f} | {t['fork_s'] * 1e3:.0f} | "
            f"{t['ratio']:.3f}x | {_yes(r['full']['found'])} | {_yes(r['once']['found'])} | "
            f"{_yes(r['per_question']['found'])} |"
        )
    am, tg = res["amortized"], res["target"]
    lines += [
        "",
        f"compress: {res['compress_median_s'] * 1e3:.0f} ms (median); with it spread over the questions, "
        f"{am['per_question_s'] * 1e3:.0f} ms a question, {am['ratio']:.3f}x the full recomputes",
        f"target (each question's TTFT <= {tg['ratio']}x full, answers no worse than once per question): "
        f"TTFT {_yes(tg['ttft_met'])}, answers {_yes(tg['answers_no_worse'])} -> {'met' if tg['met'] else 'not met'}",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a known name (kvevict.load_model) or a local folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="the haystack's length (the context is a few more)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory", type=float, default=0.2, help="compress's memory= (a share of a 16-bit stock cache)")
    p.add_argument("--cache", default=None, help="a cache spec instead of --memory (h2o/int4@0.2, kvzip@memory=0.1)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="the answers' length (timing uses 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/compress_ask.json")
    args = p.parse_args(argv)
    if args.threads < 1 or args.tokens < 64 or args.max_new_tokens < 1:
        p.error("--threads and --max-new-tokens must be >= 1, --tokens >= 64.")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.data.essays import haystack
    from kvevict.models import load_model

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    lead = not getattr(tok, "chat_template", None)
    context, facts = build_facts(haystack(tok, args.tokens), seed=args.seed, lead=lead)
    res = run(model, tok, context, facts, args.cache, args.memory, args.rounds, args.max_new_tokens)
    command = "python benchmarks/compress_ask.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    res.update(model=args.model, dtype=args.dtype, threads=args.threads, rounds=args.rounds, command=command)
    res["args"] = vars(args)
    print(table(res))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
