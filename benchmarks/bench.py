"""Decode throughput, memory, prefill cost and a step breakdown of budgeted caches against the stock
full cache (and kvpress, llama.cpp), interleaved in one process; writes JSON, markdown and PNG plots.

    python benchmarks/bench.py --quick --out results/bench-quick      # smoke run: checks the outputs, not speed
    python benchmarks/bench.py --sections matrix,llamacpp             # the decode-step matrix and llama.cpp
    python benchmarks/bench.py --stream --threads 1 --out results/stream   # the endless stream instead

Run from a checkout with kvevict installed (or ``PYTHONPATH=src``); ``--help`` lists every argument.
The pieces live in ``benchmarks/cachebench``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevict.commands._common import number_list, output_folder

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "python benchmarks/bench.py"


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (< 2 min): checks the outputs, not speed")
    p.add_argument("--out", default="results/bench", help="output folder (default results/bench)")
    p.add_argument(
        "--model", default=None, help="known name (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b) or local HF folder"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the model's dtype (default float32)")
    p.add_argument("--contexts", help="comma list of contexts (default 1024,2048,4096,8192)")
    p.add_argument("--batches", help="comma list of batch sizes (default 1,8,16)")
    p.add_argument("--budgets", help="comma list of budget fractions (default 0.1,0.2,0.5)")
    p.add_argument("--policies", help="comma list of policies (default h2o,roco,recency; missing ones are skipped)")
    p.add_argument("--repeats", type=int, help="rounds over every configuration (default 3)")
    p.add_argument("--steps", type=int, help="timed decode steps per measurement (default 4)")
    p.add_argument("--threads", type=int, help="torch threads (default: $OMP_NUM_THREADS, else half the cores)")
    p.add_argument("--kv-memory-gib", type=float, help="cache memory for the largest-batch section (default 4)")
    p.add_argument("--prefill-context", type=int, help="prompt length of the prefill section (default 8192)")
    p.add_argument("--prefill-modes", help="comma list of sdpa,eager,kvevict (default all three)")
    p.add_argument("--prefill-repeats", type=int, help="rounds of the prefill jobs (default 1)")
    p.add_argument("--peer-presses", help="kvpress presses (default snapkv,expected_attention,knorm)")
    p.add_argument(
        "--sections", help="comma list of decode,maxbatch,breakdown,prefill,peer,matrix,llamacpp (default all)"
    )
    m = p.add_argument_group("decode-step matrix (section matrix) and the llama.cpp peer (section llamacpp)")
    m.add_argument("--matrix-contexts", help="comma list of contexts (default 2048,4096,8192)")
    m.add_argument("--matrix-batches", help="comma list of batch sizes (default 1,4,8)")
    m.add_argument("--matrix-threads", help="comma list of torch thread counts, each timed in turn (default 1,2)")
    m.add_argument(
        "--matrix-caches",
        help="comma list of caches: stock, POLICY[/STORAGE]@FRACTION, memory=FRACTION, "
        "kvevict-full[/STORAGE] (default: the ten of cachebench/matrix.py's CACHES)",
    )
    m.add_argument(
        "--chat-tokens", type=int, help="prompt tokens of the short chat whose bytes are compared (default 50)"
    )
    m.add_argument("--llama-contexts", help="comma list of llama-bench depths (default 3072,8192)")
    m.add_argument("--llama-threads", help="comma list of llama-bench thread counts (default 1,2)")
    m.add_argument("--llama-repeats", type=int, help="interleaved rounds of llama-bench calls (default 2)")
    m.add_argument("--llama-gen", type=int, help="tokens llama-bench generates per timed run (default 32)")
    m.add_argument("--llama-reps", type=int, help="llama-bench -r: timed runs per call (default 3)")
    g = p.add_argument_group("endless stream (--stream: this benchmark instead of the sections above)")
    g.add_argument(
        "--stream",
        action="store_true",
        help="stream a long real text: perplexity per window and memory, vs the stock cache",
    )
    g.add_argument("--stream-tokens", type=int, help="tokens to stream (default 100000)")
    g.add_argument("--stream-budget", type=int, help="tokens kept per layer and KV head (default 1024)")
    g.add_argument("--stream-block", type=int, help="tokens per forward (default 512)")
    g.add_argument("--stream-window", type=int, help="tokens per perplexity window (default 1024)")
    g.add_argument("--stream-stock-tokens", type=int, help="how far the stock cache goes (default 12288)")
    return p


def settings_from(args):
    from benchmarks.cachebench.settings import Settings, quick_settings

    given = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "steps": args.steps,
        "kv_memory_gib": args.kv_memory_gib,
        "prefill_context": args.prefill_context,
        "prefill_repeats": args.prefill_repeats,
        "contexts": number_list(args.contexts, "--contexts", int) if args.contexts else None,
        "batches": number_list(args.batches, "--batches", int) if args.batches else None,
        "budgets": number_list(args.budgets, "--budgets") if args.budgets else None,
        "policies": _names(args.policies) if args.policies else None,
        "prefill_modes": _names(args.prefill_modes) if args.prefill_modes else None,
        "peer_presses": _names(args.peer_presses) if args.peer_presses else None,
        "sections": _names(args.sections) if args.sections else None,
        "chat_tokens": args.chat_tokens,
        "llama_repeats": args.llama_repeats,
        "llama_gen": args.llama_gen,
        "llama_reps": args.llama_reps,
        "matrix_caches": _names(args.matrix_caches) if args.matrix_caches else None,
    }
    for name in ("matrix_contexts", "matrix_batches", "matrix_threads", "llama_contexts", "llama_threads"):
        text = getattr(args, name)
        given[name] = number_list(text, "--" + name.replace("_", "-"), int) if text else None
    if args.quick:
        return quick_settings(**given)
    return Settings(**{k: v for k, v in given.items() if v is not None})


def stream_settings_from(args):
    from benchmarks.cachebench.stream import StreamSettings

    given = {
        "model": args.model,
        "threads": args.threads,
        "tokens": args.stream_tokens,
        "budget": args.stream_budget,
        "block": args.stream_block,
        "window": args.stream_window,
        "stock_tokens": args.stream_stock_tokens,
        "policies": _names(args.policies) if args.policies else None,
    }
    settings = StreamSettings(**{k: v for k, v in given.items() if v is not None})
    settings.check()
    return settings


def run(args, command: str) -> int:
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.stream:
        from benchmarks.cachebench.stream import run_stream_bench

        settings = stream_settings_from(args)
        out = output_folder(args.out)
        run_stream_bench(settings, out, command=command, log=log)
        print((out / "stream.md").read_text())
        return 0
    from benchmarks.cachebench.run import run_bench

    settings = settings_from(args)
    out = output_folder(args.out)
    res = run_bench(settings, out, command=command, log=log)
    print()
    print((out / "bench.md").read_text().split("## Decode")[0])
    return 0 if res else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, command=" ".join([PROG, *argv]))
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
