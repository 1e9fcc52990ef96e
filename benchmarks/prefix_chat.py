"""A multi-turn chat over one long document through ``kvevict serve``, with the prompt-prefix store
on and off: the time to first token of every turn, and how many such contexts the store holds.

    python benchmarks/prefix_chat.py --model smollm2-135m --tokens 4096 --turns 4 --threads 2

Each round starts a fresh server with the store on (``--prefix-cache-memory``) and one with it off,
over the same model, and runs the same conversation on each: the system prompt holds the document
(``kvevict.data.essays``), every turn is one question, streamed, and its answer goes into the next
turn's history. The time to first token is measured by the client (sending the request to the
first text of the answer). With the store on, turn 1 stores the document's cache and turn k > 1
reuses the longest stored prefix (the document and the earlier turns) and prefills the rest.

Also reported: the bytes the store holds for the document alone (one entry) against what a 16-bit
lossless prefix cache would hold for the same tokens (``kvevict.stock``), as contexts per
``--capacity`` of K/V; and, recomputed with the library, how much of each turn's newest message the
cache still holds after the two-part prefill (the smallest share over layers and KV heads).
Prints a table and writes JSON (--out). Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is the first essay in this document about? Answer in two sentences.",
    "Which example does the author give to support that point?",
    "Does the author change their mind anywhere? Quote one line.",
    "Summarise the whole document in one sentence.",
    "What would the author say to a beginner?",
    "Name three words the author uses often.",
]
SYSTEM = "Answer questions about the document below, briefly.\n\n"


def ask(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first text, the whole answer) of one streamed greedy chat request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read().decode()}")
    first, text = None, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        if delta and first is None:
            first = time.perf_counter() - start
        text.append(delta)
    conn.close()
    return (first if first is not None else time.perf_counter() - start), "".join(text)


def run_server(model, tok, settings: dict, document: str, turns: int, max_tokens: int) -> tuple[list[dict], dict]:
    """A fresh engine and server over ``model``: the conversation, and the store's bytes after turn 1."""
    from kvevict.serve.app import create_app
    from kvevict.serve.engine import Engine
    from kvevict.serve.server import ServerThread
    from kvevict.serve.settings import Settings

    engine = Engine(model, tok, Settings(**settings)).start()
    with ServerThread(create_app(engine)) as srv:
        store = {}
        turns_out = []
        for k in range(turns):
            turns_out += conversation_turn(engine, srv.url, document, turns_out, k, max_tokens)
            if k == 0 and engine.prefixes is not None:  # the document alone: one entry
                system = turns_out[0]["messages"][:1]
                tokens = len(engine.tokenizer.apply_chat_template(system, tokenize=True, return_dict=True)["input_ids"])
                store = {
                    "bytes": engine.prefixes.nbytes,
                    "tokens": tokens,
                    "lossless": engine.budgeter.stock_bytes(tokens),
                }
    return turns_out, store


def conversation_turn(engine, url, document, done: list[dict], k: int, max_tokens: int) -> list[dict]:
    """Turn ``k`` of the chat whose earlier turns are ``done``: its prompt's tokens, what it reused
    (the engine's log of prefix prefills; 0 with the store off), its time to first token, its answer."""
    messages = [{"role": "system", "content": SYSTEM + document}]
    for i, t in enumerate(done):
        messages += [
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
            {"role": "assistant", "content": t["answer"]},
        ]
    messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
    seen = len(engine.log)
    ttft, answer = ask(url, messages, max_tokens)
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    fills = [e for e in list(engine.log)[seen:] if e["event"] == "prefix"]
    reused = fills[-1]["reused"] if fills else 0
    return [
        {
            "turn": k + 1,
            "prompt_tokens": len(ids["input_ids"]),
            "reused": reused,
            "ttft_s": ttft,
            "answer": answer,
            "messages": messages,
        }
    ]


def newest_kept(model, tok, messages: list[dict], policy: str, budget: int, bits) -> float:
    """The smallest share, over layers and KV heads, of the newest message's tokens that the cache
    holds after the server's parts (the earlier turns, then the newest), recomputed with the library."""
    from kvevict.serve.batch import DecodeBatch
    from kvevict.storage import Pools

    def n(msgs, gen):
        return len(
            tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=True)["input_ids"]
        )

    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    cut = n(messages[:-1], False)
    with torch.inference_mode():
        batch, _ = DecodeBatch.prefill(model, list(ids[:cut]), policy, budget, None, bits, Pools())
        batch.extend(list(ids[cut:]))
    worst = 1.0
    for layer in batch.cache.layers:
        held = torch.cat([p.pos[..., : p.filled] for tier in layer.tiers for p in tier.parts()], dim=-1)[0]
        for head in held:
            worst = min(worst, int(((head >= cut) & (head < len(ids))).sum()) / (len(ids) - cut))
    return worst


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="the document's tokens")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--kv-bits", default="8", help="16, 8, 4 or none")
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--prefix-cache-memory", default="512MiB")
    p.add_argument("--capacity", default="256MiB", help="K/V bytes the contexts-held comparison is made in")
    p.add_argument("--out", default="results/prefix_chat.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict.commands.serve import parse_bytes, parse_kv_bits
    from kvevict.data.essays import haystack
    from kvevict.models import load_model

    model, tok = load_model(args.model)
    document = haystack(tok, args.tokens)
    bits = None if args.policy == "full" else parse_kv_bits(args.kv_bits)
    base = dict(model_id="bench", policy=args.policy, budget=None if args.policy == "full" else args.budget)
    base.update(kv_memory=parse_bytes(args.kv_memory), max_tokens_limit=args.answer_tokens, max_batch=4)
    if args.policy != "full":
        base["kv_bits"] = bits
    runs = {"on": [], "off": []}
    store = {}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            memory = parse_bytes(args.prefix_cache_memory, "--prefix-cache-memory") if mode == "on" else 0
            turns, got = run_server(
                model, tok, {**base, "prefix_cache_memory": memory}, document, args.turns, args.answer_tokens
            )
            print(f"store {mode}: TTFT " + ", ".join(f"{t['ttft_s']:.3f}s" for t in turns), file=sys.stderr)
            runs[mode].append(turns)
            store = got or store
    report = summarise(model, tok, args, runs, store, bits)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)


def summarise(model, tok, args, runs: dict, store: dict, bits) -> dict:
    from kvevict.commands.serve import parse_bytes

    rows = []
    for k in range(args.turns):
        on = [r[k]["ttft_s"] for r in runs["on"]]
        off = [r[k]["ttft_s"] for r in runs["off"]]
        last = runs["on"][-1][k]
        kept = None
        if k and args.policy != "full":
            kept = newest_kept(model, tok, last["messages"], args.policy, args.budget, bits)
        rows.append(
            {
                "turn": k + 1,
                "prompt_tokens": last["prompt_tokens"],
                "reused_tokens": last["reused"],
                "ttft_on_s": statistics.median(on),
                "ttft_off_s": statistics.median(off),
                "ratio": statistics.median(a / b for a, b in zip(on, off)),
                "newest_turn_kept": kept,
            }
        )
    capacity = parse_bytes(args.capacity, "--capacity")
    lossless = store.get("lossless")
    contexts = {
        "prefix_tokens": store.get("tokens"),
        "compressed_bytes": store.get("bytes"),
        "lossless_16bit_bytes": lossless,
        "compressed_per_capacity": capacity // store["bytes"] if store.get("bytes") else None,
        "lossless_per_capacity": capacity // lossless if lossless else None,
    }
    return {
        "args": vars(args),
        "turns": rows,
        "contexts": contexts,
        "answers": {m: [[t["answer"] for t in r] for r in runs[m]] for m in runs},
    }


def print_table(report: dict) -> None:
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'TTFT on':>9} {'TTFT off':>9} {'on/off':>7} {'newest kept':>11}")
    for r in report["turns"]:
        kept = "-" if r["newest_turn_kept"] is None else f"{r['newest_turn_kept']:.2f}"
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['reused_tokens']:>7} {r['ttft_on_s']:>8.3f}s "
            f"{r['ttft_off_s']:>8.3f}s {r['ratio']:>7.3f} {kept:>11}"
        )
    c = report["contexts"]
    if c["compressed_bytes"] and c["lossless_16bit_bytes"]:
        print(
            f"a {c['prefix_tokens']}-token context: {c['compressed_bytes']} bytes stored, {c['lossless_16bit_bytes']} "
            f"lossless at 16 bits; per {report['args']['capacity']}: {c['compressed_per_capacity']} against "
            f"{c['lossless_per_capacity']} ({c['compressed_per_capacity'] / max(1, c['lossless_per_capacity']):.1f}x)"
        )


if __name__ == "__main__":
    main()
