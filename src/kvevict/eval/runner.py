"""The grid: task x (full + policy x budget) x sample. The full cache is always a cell (the
reference). Records already in the output folder are skipped, so re-running resumes."""

from __future__ import annotations

import math
import sys
import time

from . import records
from .apart import apart_label, check_question, protocol
from .caches import FULL


def cells_for(policies: list[str], budgets: list, question: str = "inside") -> list[tuple]:
    """The reference, then each policy at each budget; a storage that evicts nothing (``full/int4``)
    is one cell, whatever the budgets. ``question="apart"``: every cell but the reference reads the
    question after its compressed context (``kvevict.eval.apart``, policy ``NAME/context``)."""
    label = apart_label if check_question(question) == "apart" else (lambda p: p)
    keep_all = [(label(p), None) for p in policies if p.startswith(FULL + "/")]
    return (
        [(FULL, None)] + keep_all + [(label(p), b) for p in policies if not p.startswith(FULL + "/") for b in budgets]
    )


def _task_cells(task, policies, budgets, question: str, log) -> list[tuple]:
    """A task's cells: apart only where its prompt ends with its question (``Task.asks_last``)."""
    if question == "apart" and not getattr(task, "asks_last", False):
        log(f"{task.name}: no question ends its prompt; its cells keep it inside (--question apart skipped)")
        question = "inside"
    return cells_for(policies, budgets, question)


def run_grid(
    model,
    tokenizer,
    tasks,
    policies,
    budgets,
    n_samples: int,
    out_dir,
    model_name: str,
    log=None,
    first: int = 0,
    question: str = "inside",
) -> int:
    """Run every missing cell of samples ``first`` .. ``n_samples - 1`` of every task; return the number
    of records written. ``first`` splits one grid across processes or machines: each runs its range
    into its own folder, and the records merge (each is keyed by its sample's id). A cell that raises (a
    policy that cannot run at some budget, say) is reported and skipped. ``question``: "inside" (the
    prompt compressed with its question) or "apart" (``kvevict.eval.apart``); every record says which."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_question(question)
    done = records.load(out_dir)
    writer = records.Writer(out_dir)
    written, start = 0, time.perf_counter()
    try:
        for task in tasks:
            cells = _task_cells(task, policies, budgets, question, log)
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
                rec = _record(model_name, task.name, cell, sample.id, res)
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


def _record(model_name: str, task_name: str, cell: tuple, sample_id: str, res: dict) -> dict:
    """One cell's record: the cell, its sample, how its question was read, and what it scored."""
    policy, budget = cell
    head = {"model": model_name, "task": task_name, "policy": policy, "budget": budget, "sample": sample_id}
    return {**head, "question": protocol(policy), **res}


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
