"""The grid: task x (full + policy x budget) x sample. The full cache is always a cell (the
reference). Records already in the output folder are skipped, so re-running resumes."""

from __future__ import annotations

import math
import sys
import time

from . import records
from .caches import FULL


def cells_for(policies: list[str], budgets: list) -> list[tuple]:
    """The reference, then each policy at each budget; a storage that evicts nothing (``full/int4``)
    is one cell, whatever the budgets."""
    keep_all = [(p, None) for p in policies if p.startswith(FULL + "/")]
    return [(FULL, None)] + keep_all + [(p, b) for p in policies if not p.startswith(FULL + "/") for b in budgets]


def run_grid(
    model, tokenizer, tasks, policies, budgets, n_samples: int, out_dir, model_name: str, log=None, first: int = 0
) -> int:
    """Run every missing cell of samples ``first`` .. ``n_samples - 1`` of every task; return the number
    of records written. ``first`` splits one grid across processes or machines: each runs its range
    into its own folder, and the records merge (each is keyed by its sample's id). A cell that raises (a
    policy that cannot run at some budget, say) is reported and skipped."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cells = cells_for(policies, budgets)
    done = records.load(out_dir)
    writer = records.Writer(out_dir)
    written, start = 0, time.perf_counter()
    try:
        for task in tasks:
            samples = task.samples(tokenizer, n_samples)
            if len(samples) < n_samples:
                log(f"{task.name}: only {len(samples)} samples available (asked for {n_samples})")
            samples = samples[first:]
            total = len(samples) * len(cells)
            have = sum(records.record_key(task.name, p, b, s.id, model_name) in done for s in samples for p, b in cells)
            t_task = time.perf_counter()
            state = {"new": 0, "have": have}

            def emit(sample, cell, res, task=task, state=state, total=total, t_task=t_task):
                key = records.record_key(task.name, *cell, sample.id, model_name)
                if key in done:
                    return
                rec = {
                    "model": model_name,
                    "task": task.name,
                    "policy": cell[0],
                    "budget": cell[1],
                    "sample": sample.id,
                    **res,
                }
                writer.write(rec)
                done[key] = rec
                state["new"] += 1
                state["have"] += 1
                eta = (time.perf_counter() - t_task) / state["new"] * (total - state["have"])
                log(
                    f"  [{task.name}] {sample.id} {cell[0]}@{cell[1]}: {_brief(res)}; "
                    f"{state['have']}/{total} done, ETA {_fmt(eta)}"
                )

            for i, sample in enumerate(samples):
                todo = [c for c in cells if records.record_key(task.name, *c, sample.id, model_name) not in done]
                if not todo:
                    continue
                log(f"[{task.name} {i + 1}/{len(samples)}] {sample.id}: {len(todo)} cells")
                ref = done.get(records.record_key(task.name, FULL, None, sample.id, model_name))
                task.on_cell = lambda cell, res, sample=sample: emit(sample, cell, res)
                before = state["new"]
                results = _evaluate(
                    task,
                    model,
                    tokenizer,
                    sample,
                    todo,
                    ref,
                    log,
                    lambda c, s=sample: records.record_key(task.name, *c, s.id, model_name) not in done,
                )
                for cell, res in results.items():  # tasks that score all cells at once report here
                    emit(sample, cell, res)
                written += state["new"] - before
    finally:
        writer.close()
    log(f"wrote {written} records in {_fmt(time.perf_counter() - start)} to {out_dir}")
    return written


def _evaluate(task, model, tokenizer, sample, todo, ref, log, pending):
    try:
        return task.evaluate(model, tokenizer, sample, todo, ref)
    except ValueError as err:
        if len(todo) == 1:
            log(f"  skipped {todo[0]} on {sample.id}: {err}")
            return {}
    # one bad cell must not lose the others: retry those not yet written, one at a time
    out = {}
    for cell in todo:
        if cell[0] == FULL or not pending(cell):
            continue
        try:
            out.update(task.evaluate(model, tokenizer, sample, [cell], ref))
        except ValueError as err:
            log(f"  skipped {cell} on {sample.id}: {err}")
    if (FULL, None) in todo and pending((FULL, None)):
        out.update(task.evaluate(model, tokenizer, sample, [(FULL, None)], ref))
    return out


def _brief(res: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in res.get("scores", {}).items())


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
