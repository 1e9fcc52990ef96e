"""The grid's results file: one JSON object per line and per (task, policy, budget, sample),
appended and flushed as each is computed, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

from ..peers.kvpress_presses import MASKING

FILE = "records.jsonl"
# records written since budgets are counted against a 16-bit stock cache carry it: full_kv_bytes is
# a stock cache at 16 bits; older ones counted every layer at every token in the model's dtype
# (see bytes_report.stock_share)
BASIS = "stock16"
# kvpress records carry how the peer decoded after its press: before each token was fed at its own
# position (kvpress_child.greedy), model.generate refilled a pressed cache that the press had made
# shorter with most of the prompt, so such a record measured no press at all. Loading drops those:
# a folder re-runs them instead of reporting them. kvpress's KVzip and Ada-KV presses keep every key
# (they mask the evicted ones, ``MASKING``), so nothing was refilled: their records stand.
PEER_DECODE = "own-positions"


def stale(rec: dict) -> bool:
    """A kvpress record of a shortening press from the harness that refilled it (see ``PEER_DECODE``)."""
    policy = str(rec.get("policy", ""))
    press = policy.removeprefix("kvpress-").split("/")[0]
    return policy.startswith("kvpress-") and press not in MASKING and rec.get("decode") != PEER_DECODE


def budget_key(budget) -> str:
    return "full" if budget is None else repr(budget)


def record_key(rec_or_task, policy=None, budget=None, sample=None, model=None) -> tuple:
    if isinstance(rec_or_task, dict):
        r = rec_or_task
        return (r["model"], r["task"], r["policy"], budget_key(r["budget"]), r["sample"])
    return (model, rec_or_task, policy, budget_key(budget), sample)


def load(out_dir) -> dict[tuple, dict]:
    """Records already written (a torn last line from a killed run is skipped, and so is a ``stale``
    kvpress record)."""
    path = Path(out_dir) / FILE
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not stale(rec):
                done[record_key(rec)] = rec
    return done


class Writer:
    def __init__(self, out_dir):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / FILE
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        self._fh = open(self.path, "a", encoding="utf-8")
        if text and not text.endswith("\n"):
            self._fh.write("\n")  # a killed run may have left half a line: start a fresh one

    def write(self, rec: dict) -> None:
        if "full_kv_bytes" in rec:  # what full_kv_bytes counts: a 16-bit stock cache (kvevict.stock)
            rec = {**rec, "bytes_basis": BASIS}
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self):
        self._fh.close()
