"""``run_grid``: run ``fn`` on every item of a grid, append each result to one JSONL file, and on a
re-run skip the items already there.

Contract
- ``items``: JSON-serialisable dicts, one per unit of work (e.g. {"task": "passkey", "policy":
  "h2o", "budget": 0.2, "sample": 3}). An item's identity is its ``"key"`` field if it has one,
  else its canonical JSON (sorted keys); two items with the same identity are one item.
- ``fn``: a ``"package.module:function"`` path (workers import it; no closures), called as
  ``fn(model, tokenizer, item)`` with the worker's model (loaded once per worker by
  ``kvevict.load_model(model)``; both None when ``model`` is None). It returns a JSON-serialisable
  dict, or a list of them (several records for one item).
- Output: each record is written as one line ``{**item, **record, "grid_key": key}`` in the order
  items finish, flushed at once, by this process only (workers never write), so a killed run
  loses at most the items in flight. An item whose fn raised is not written (a re-run retries it);
  its error is in the returned summary.
- Resume: items whose ``grid_key`` is already in ``out`` are skipped.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GridSummary:
    done: int = 0  # items run now
    skipped: int = 0  # items already in the file
    records: int = 0  # lines written now
    failed: dict = field(default_factory=dict)  # key -> error text


def item_key(item: dict) -> str:
    if not isinstance(item, dict):
        raise ValueError(f"grid items must be dicts, got {type(item).__name__}.")
    if "key" in item:
        return str(item["key"])
    try:
        return json.dumps(item, sort_keys=True, separators=(",", ":"))
    except TypeError as err:
        raise ValueError(f"grid item is not JSON-serialisable: {err}") from None


def read_records(out) -> list[dict]:
    """Every record of a grid file (a torn last line from a killed run is ignored)."""
    path = Path(out)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def run_grid(
    items,
    fn: str,
    model: str | None,
    out,
    executor="local",
    workers: int | None = None,
    threads: int | None = None,
    progress=True,
) -> GridSummary:
    """Run the items not yet in ``out`` through ``executor`` ("inline", "local", "ray[:ADDRESS]" or
    an executor object from kvevict.distributed.executors)."""
    from .executors import make_executor

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done_keys = {r.get("grid_key") for r in read_records(out)}
    keyed, seen = [], set()
    for item in items:
        k = item_key(item)
        if k not in seen:
            seen.add(k)
            keyed.append((k, item))
    summary = GridSummary(skipped=sum(k in done_keys for k, _ in keyed))
    todo = [(k, it) for k, it in keyed if k not in done_keys]
    if not todo:
        return summary
    by_key = dict(todo)
    ex = make_executor(executor, model, workers, threads) if isinstance(executor, str) or executor is None else executor
    try:
        with out.open("a", encoding="utf-8") as f:
            if out.stat().st_size and not _ends_with_newline(out):
                f.write("\n")  # a torn line from a killed run stays alone on its line
            for i, (key, records, error) in enumerate(ex.map(fn, todo), 1):
                if error is not None:
                    summary.failed[key] = error
                else:
                    for rec in records:
                        f.write(json.dumps({**by_key[key], **rec, "grid_key": key}) + "\n")
                    f.flush()
                    summary.records += len(records)
                summary.done += 1
                if progress:
                    status = "failed" if error else "ok"
                    print(f"[{i}/{len(todo)}] {status} {key[:100]}", file=sys.stderr)
    finally:
        if isinstance(executor, str) or executor is None:
            ex.close()
    return summary


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
