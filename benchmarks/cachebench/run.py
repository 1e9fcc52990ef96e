"""One ``python benchmarks/bench.py`` run: every section in one process (prefill jobs in child processes so
their peak memory is their own), then JSON + markdown + PNG plots in the output folder."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

from kvevict.commands._common import default_threads

from . import report, targets
from .caches import NO_EVICTION, STOCK, CacheSpec, available_policies, specs_for
from .machine import load_average, machine_info, measure_copy_bandwidth
from .memory_math import floor_seconds, model_kv_bytes_per_token
from .settings import Settings, check


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, tied ones counted once (``parameters()`` dedups)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def add_floors(records: list[dict], weights: int, kv_per_token: int, bandwidth: float) -> None:
    for r in records:
        r["floor_s"] = floor_seconds(weights, r["batch"] * r["kept_tokens"] * kv_per_token, bandwidth)


def run_bench(s: Settings, out_dir: Path, command: str = "", log=print) -> dict:
    import torch

    from .breakdown import run_breakdown
    from .decode import BaseCaches, add_ratios, run_interleaved
    from .loading import load_for_bench, model_folder
    from .maxbatch import run_maxbatch
    from .subprocess_jobs import (
        VENV_COMMAND,
        kvevict_jobs,
        kvpress_jobs,
        kvpress_python,
        run_jobs,
    )

    check(s)
    t_start = time.perf_counter()
    threads = s.threads or default_threads()  # not every core: see default_threads
    torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": command, "settings": s.as_dict(), "machine": machine_info(), "notes": []}
    log(f"bench: {threads} torch threads, load average {load_average()}")
    policies, notes = available_policies(s.policies)
    res["notes"] += notes
    for n in notes:
        log(f"  note: {n}")
    res["bandwidth"] = measure_copy_bandwidth(32 * 2**20 if s.quick else 256 * 2**20)
    model = load_for_bench(s.model, s.dtype)
    # the imports and the model are a heap of long-lived objects that every full collection would
    # walk again (about a second per gc.collect() here, twice per timed point): take them out of it
    gc.freeze()
    res["weight_bytes"] = weight_bytes(model)
    res["kv_bytes_per_token"] = model_kv_bytes_per_token(model.config)
    bw = res["bandwidth"]["best"]
    bases = BaseCaches(model, decode_tokens=1 + s.steps, seed=s.seed, log=log)
    target_policy = "h2o" if "h2o" in policies else (policies[0] if policies else None)

    if "decode" in s.sections:
        log("decode grid (interleaved):")
        points = [(c, b, spec) for c in s.contexts for b in s.batches for spec in specs_for(policies, s.budgets)]
        recs = run_interleaved(model, bases, points, s.repeats, s.steps, log=log)
        add_ratios(recs)
        add_floors(recs, res["weight_bytes"], res["kv_bytes_per_token"], bw)
        res["decode"] = {
            "records": recs,
            "fill_seconds": dict(bases.prefill_seconds),
            "method": "caches pre-filled once at batch 1 (see cachebench/caches.py), copied per run; "
            "one untimed warm-up step, then the timed steps",
        }
    if "maxbatch" in s.sections:
        log(f"largest batch in {s.kv_memory_gib:g} GiB at context {max(s.contexts)}:")
        specs = [CacheSpec(STOCK)] + [CacheSpec(p, s.target_budget) for p in policies]
        res["maxbatch"] = run_maxbatch(
            model, bases, max(s.contexts), specs, int(s.kv_memory_gib * 2**30), s.repeats, s.steps, log=log
        )
    if "breakdown" in s.sections:
        log(f"decode step breakdown at context {s.target_context}, batch {s.target_batch}:")
        specs = [CacheSpec(STOCK), CacheSpec(NO_EVICTION)] + [CacheSpec(p, s.target_budget) for p in policies]
        res["breakdown"] = run_breakdown(
            model, bases, s.target_context, s.target_batch, specs, max(2, s.steps), log=log
        )
    if "matrix" in s.sections:
        res["matrix"] = run_matrix_section(model, bases, s, res["weight_bytes"], log)
    del bases, model
    gc.collect()
    if "llamacpp" in s.sections:
        res["llamacpp"] = run_llamacpp_section(s, log)
    if res.get("matrix"):
        from .matrix import peer_comparison

        res["matrix"]["peer_comparison"] = peer_comparison(res["matrix"]["records"], res.get("llamacpp"))

    jobs, pre_notes = [], []
    if "prefill" in s.sections:
        modes = [m for m in s.prefill_modes if m != "kvevict" or target_policy]
        jobs += kvevict_jobs(
            s.model,
            modes,
            target_policy or "",
            s.target_budget,
            s.prefill_context,
            s.prefill_decode_steps,
            threads,
            s.seed,
        )
    if "peer" in s.sections:
        py = kvpress_python()
        if py is None:
            pre_notes.append(f"kvpress peer skipped: no kvpress environment found (create it with: {VENV_COMMAND})")
            log(f"  note: {pre_notes[-1]}")
        else:
            jobs += kvpress_jobs(
                py,
                model_folder(s.model),
                s.peer_presses,
                s.target_budget,
                s.prefill_context,
                s.prefill_decode_steps,
                threads,
                s.seed,
            )
    if jobs:
        log(f"prefill of {s.prefill_context} tokens, one process per run:")
        res["prefill"] = {
            "context": s.prefill_context,
            "decode_steps": s.prefill_decode_steps,
            "notes": pre_notes,
            "records": run_jobs(jobs, s.prefill_repeats, log=log),
        }
    elif pre_notes:
        res["notes"] += pre_notes

    gc.unfreeze()
    res["machine"]["load_average_end"] = load_average()
    res["seconds"] = time.perf_counter() - t_start
    res["targets"] = targets.evaluate(res, target_policy, s.target_budget, s.target_context, s.target_batch)
    write_outputs(res, out_dir)
    log(f"wrote {out_dir}/bench.json, bench.md and plots in {res['seconds']:.0f} s")
    return res


def run_matrix_section(model, bases, s: Settings, weight_bytes: int, log) -> dict:
    from .matrix import chat_bytes, long_bytes, parse_caches, run_matrix

    specs = parse_caches(s.matrix_caches)
    log(f"decode-step matrix (interleaved; attention kernel: {os.environ.get('KVEVICT_KERNEL') or 'default'}):")
    out = run_matrix(
        model,
        bases,
        specs,
        s.matrix_contexts,
        s.matrix_batches,
        s.matrix_threads,
        s.repeats,
        s.steps,
        weight_bytes,
        32 * 2**20 if s.quick else 256 * 2**20,
        log=log,
    )
    out["bytes_held"] = {
        "chat": chat_bytes(model, specs, prompt=s.chat_tokens, seed=s.seed),
        "long": long_bytes(bases, specs, s.matrix_contexts),
    }
    return out


def run_llamacpp_section(s: Settings, log) -> dict:
    """llama-bench on the model's own GGUF, when both are there; otherwise a note saying why not."""
    from kvevict.peers.locations import find, hint

    from .llamacpp_peer import model_gguf, run_peer

    binary = find("llamacpp")
    if binary is None:
        note = f"llama.cpp peer skipped: no llama-bench found (build it with: {hint('llamacpp')})"
        log(f"  note: {note}")
        return {"note": note}
    gguf = model_gguf(s.model)
    if gguf is None:
        note = f"llama.cpp peer skipped: {s.model!r} is not a known model with a GGUF"
        log(f"  note: {note}")
        return {"note": note}
    log(f"llama.cpp peer ({binary.name}, {gguf.name}), interleaved rounds:")
    out = run_peer(
        binary,
        gguf,
        s.llama_contexts,
        s.llama_threads,
        s.llama_repeats,
        n_gen=s.llama_gen,
        repetitions=s.llama_reps,
        log=log,
    )
    out.update(binary=binary.name, gguf=gguf.name)
    return out


def write_outputs(res: dict, out_dir: Path) -> None:
    from kvevict.plotting import available

    from . import plots

    (out_dir / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out_dir / "bench.md").write_text(report.render(res))
    if res.get("decode"):
        if not available():
            print("bench: plots skipped: matplotlib is missing (pip install 'kvevict[bench]')")
            return
        plots.throughput_vs_context(res["decode"]["records"], out_dir / "throughput_vs_context.png")
        plots.memory_vs_context(res["decode"]["records"], out_dir / "memory_vs_context.png")
    if res.get("matrix") and available():
        plots.matrix_steps(res["matrix"]["records"], out_dir / "matrix_steps.png")
