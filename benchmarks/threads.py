"""The thread trap, measured: one budgeted decode step with N torch threads, alone and next to busy
processes (each a pure-Python spin loop holding one core).

    python benchmarks/threads.py --threads 1,2 --busy 0,1 --out results/threads

Torch's default is one thread per core. Its threads spin-wait at the end of every parallel region,
so when a busy neighbour holds a core, each region waits for a descheduled thread (a scheduler time
slice) and the step gets many times slower. Ratios are against 1 thread with the same neighbours,
timed in the same round; rounds rotate the order.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import torch


def _spin(stop) -> None:
    while not stop.is_set():
        pass


class BusyNeighbours:
    """``n`` processes each spinning on one core until the context exits."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5 if self.n else 0)  # let them reach the loop
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(5)


@torch.no_grad()
def step_times(model, cache, steps: int) -> list[float]:
    ids = torch.ones(1, 1, dtype=torch.long)
    model(ids, cache=cache)  # warm-up at this thread count
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(ids, cache=cache)
        out.append(time.perf_counter() - t0)
    return out


def run(
    model_name: str, thread_counts: list[int], busy_counts: list[int], context: int, steps: int, rounds: int, log=print
) -> dict:
    from kvevict.cache import make_cache
    from kvevict.models import load_model

    model, _ = load_model(model_name)
    prompt = torch.randint(10, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    rows = []
    for busy in busy_counts:
        with BusyNeighbours(busy):
            times = {t: [] for t in thread_counts}
            for r in range(rounds):
                order = thread_counts[r % len(thread_counts) :] + thread_counts[: r % len(thread_counts)]
                for t in order:
                    torch.set_num_threads(t)
                    cache = make_cache(model, "h2o", 0.2)
                    with torch.no_grad():
                        model(prompt, cache=cache)
                    times[t].append(statistics.median(step_times(model, cache, steps)))
            base = times[thread_counts[0]]
            for t in thread_counts:
                ratios = [x / b for x, b in zip(times[t], base)]
                rows.append(
                    {
                        "busy": busy,
                        "threads": t,
                        "round_median_step_s": times[t],
                        "step_s": statistics.median(times[t]),
                        "vs_first": statistics.median(ratios),
                    }
                )
                log(
                    f"busy {busy}, threads {t}: step {rows[-1]['step_s'] * 1e3:8.1f} ms "
                    f"(x{rows[-1]['vs_first']:.2f} of {thread_counts[0]} thread(s))"
                )
    return {
        "model": model_name,
        "context": context,
        "steps": steps,
        "rounds": rounds,
        "rows": rows,
        "cores": os.cpu_count(),
    }


def table(res: dict, command: str) -> str:
    first = res["rows"][0]["threads"]
    lines = [
        f"`{command}`",
        "",
        f"{res['cores']} cores; h2o@0.2 decode step after a {res['context']}-token "
        f"prompt, batch 1; median over {res['rounds']} rounds of each round's median of {res['steps']} steps.",
        "",
        f"| busy neighbours | threads | step ms | vs {first} thread(s), same round |",
        "|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['busy']} | {r['threads']} | {r['step_s'] * 1e3:.1f} | {r['vs_first']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import sys

    from kvevict.commands._common import number_list, output_folder

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (the first is the baseline)")
    p.add_argument("--busy", default="0,1", help="comma list of busy neighbour processes")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/threads")
    args = p.parse_args(argv)
    try:
        threads = number_list(args.threads, "--threads", int)
        busy = number_list(args.busy, "--busy", int)
        if not threads or min(threads) < 1 or not busy or min(busy) < 0:
            raise ValueError("--threads needs counts >= 1 and --busy counts >= 0.")
        out = output_folder(args.out)
    except ValueError as err:
        p.error(str(err))
    command = "python benchmarks/threads.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = run(args.model, threads, busy, args.context, args.steps, args.rounds)
    res["command"] = command
    (out / "threads.json").write_text(json.dumps(res, indent=1))
    (out / "threads.md").write_text(table(res, command))
    print(table(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
