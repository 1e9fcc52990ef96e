"""``kvevict eval --peer kvpress``: kvpress's presses on the very samples of kvevict's generation
tasks, at compression_ratio = 1 - budget, written as records of policy ``kvpress-<press>`` in the
same folder, so the summary pairs them with the full cache and kvevict's policies sample by sample.
kvpress runs in its own environment (see kvevict.peers.locations), one process per press and
budget, the prompts tokenized here with kvevict's tokenizer.

``question="apart"`` runs kvpress's own protocol instead: the context pressed alone, the question read
after it unpressed (records of policy ``kvpress-<press>/context``). The context's ratio is set per
sample so that context kept plus question is the budget's share of the prompt, the same tokens as
``question="pressed"`` holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import records
from .apart import question_length
from .tasks.base import GenerationTask

CHILD = Path(__file__).with_name("kvpress_child.py")
PRESSES = (
    "snapkv",
    "tova",
    "knorm",
    "expected_attention",
    "observed_attention",
    "adakv_snapkv",
    "adakv_expected_attention",
    "kvzip",
)
QUESTION = ("pressed", "apart")


def press_names(requested: str) -> list[str]:
    items = [p.strip().lower() for p in requested.split(",") if p.strip()]
    bad = [p for p in items if p not in PRESSES]
    if bad or not items:
        raise ValueError(
            f"unknown kvpress press {', '.join(map(repr, bad)) or '(none given)'}; known: {', '.join(PRESSES)}."
        )
    return items


def context_ratio(budget: float, n: int, q: int) -> float:
    """kvpress's compression ratio over the context (``n - q`` tokens) that keeps ``budget * n``
    tokens with the ``q`` question tokens held whole: 1 - (budget * n - q) / (n - q)."""
    if budget * n <= q:
        raise ValueError(
            f"budget {budget:g} of a {n}-token prompt is {budget * n:.0f} tokens, no more than its question "
            f"({q}): raise the budget, or run --peer-question pressed."
        )
    return round(1.0 - (budget * n - q) / (n - q), 6)


def run_peer(
    model_name,
    tokenizer,
    tasks,
    presses,
    budgets,
    n_samples,
    out_dir,
    threads=1,
    log=None,
    dtype="float32",
    question="pressed",
    first=0,
) -> int:
    """Run every missing (task, kvpress press, budget, sample) record of samples ``first`` ..
    ``n_samples - 1``; return how many were written.
    ``dtype``: the model's weights and activations in kvpress's process, as kvevict's own cells ran.
    ``question``: "pressed" with the context, or "apart" (see the module's docstring)."""
    if question not in QUESTION:
        raise ValueError(f"question={question!r}: choose {' or '.join(QUESTION)}.")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    py, model_dir = _peer_python_and_model(model_name)
    done, writer, written = records.load(out_dir), records.Writer(out_dir), 0
    peer = _Peer(py, model_dir, model_name, tokenizer, threads, dtype, question, log, done, writer)
    try:
        for task in tasks:
            if not isinstance(task, GenerationTask):
                log(f"kvpress peer: {task.name} is not a generation task; skipped")
                continue
            samples = task.samples(tokenizer, n_samples)[first:]
            for press in presses:
                for budget in budgets:
                    written += peer.run(task, samples, press, budget)
    finally:
        writer.close()
    return written


def _peer_python_and_model(model_name):
    """(kvpress's Python, the converted model's folder), or a ValueError that says what is missing."""
    from ..fetch import cache_dir
    from ..peers.locations import find, hint

    py = find("kvpress")
    if py is None:
        raise ValueError(f"--peer kvpress needs the kvpress environment: create it with {hint('kvpress')}")
    model_dir = cache_dir() / model_name
    if not (model_dir / "config.json").exists():
        raise ValueError(f"--peer kvpress runs on the converted copy of a known model ({model_dir} is missing).")
    return py, model_dir


@dataclass
class _Peer:
    """What every (task, press, budget) of one ``run_peer`` shares: kvpress's Python, the model,
    the records done so far and the writer of new ones."""

    py: Path
    model_dir: Path
    model_name: str
    tokenizer: Any
    threads: int
    dtype: str
    question: str
    log: Callable[[str], None]
    done: dict
    writer: records.Writer

    def run(self, task, samples, press, budget) -> int:
        """One press at one budget on the samples of ``task`` that have no record yet, in one
        kvpress process; how many records were written."""
        if not isinstance(budget, float):
            raise ValueError("--peer kvpress takes fractional budgets (kvpress compresses by ratio).")
        policy = f"kvpress-{press}" + ("/context" if self.question == "apart" else "")
        todo = [
            s for s in samples if records.record_key(task.name, policy, budget, s.id, self.model_name) not in self.done
        ]
        if not todo:
            return 0
        by_id, written = {s.id: s for s in todo}, 0
        job = {
            "model_dir": str(self.model_dir),
            "press": press,
            "compression_ratio": round(1.0 - budget, 6),
            "threads": self.threads,
            "dtype": self.dtype,
            "samples": [_job_sample(self.tokenizer, task, s, budget, self.question) for s in todo],
        }
        self.log(f"[kvpress {press}@{budget:g}] {task.name}: {len(todo)} samples")
        for line in _stream(self.py, job, self.log):
            s = by_id[line["id"]]
            rec = self.record(task, policy, budget, s, line)
            self.writer.write(rec)
            self.done[records.record_key(rec)] = rec
            written += 1
            self.log(f"  {s.id} {policy}@{budget:g}: {rec['scores']}")
        return written

    def record(self, task, policy: str, budget: float, sample, line: dict) -> dict:
        """The record of one sample's answer, as kvpress's process reported it in ``line``."""
        text = self.tokenizer.decode(line["new_ids"], skip_special_tokens=True).strip()
        return {
            "model": self.model_name,
            "task": task.name,
            "policy": policy,
            "budget": budget,
            "sample": sample.id,
            "scores": task.score(sample, text, None),
            "output": text,
            "kv_tokens": line["kv_tokens"],
            "seconds": line["seconds"],
            "decode": records.PEER_DECODE,
        }


def check_question_fits(tokenizer, tasks, budgets, n_samples, first=0) -> None:
    """For ``question="apart"``: a ValueError now, before kvevict's own cells run for hours, if some
    budget holds no more tokens than some sample's question (``context_ratio``)."""
    from ..generate import encode_chat

    for task in tasks:
        if isinstance(task, GenerationTask):
            for s in task.samples(tokenizer, n_samples)[first:]:
                n, q = encode_chat(tokenizer, s.data["messages"]).shape[-1], question_length(tokenizer, s)
                for budget in budgets:
                    if isinstance(budget, float):
                        context_ratio(budget, n, q)


def _job_sample(tokenizer, task, sample, budget, question) -> dict:
    from ..generate import encode_chat

    ids = encode_chat(tokenizer, sample.data["messages"])[0].tolist()
    out = {"id": sample.id, "ids": ids, "max_new": task.max_new(sample, tokenizer)}
    if question == "apart":
        q = question_length(tokenizer, sample)
        out.update(question=q, compression_ratio=context_ratio(budget, len(ids), q))
    return out


def _stream(py, job, log):
    # stderr to a file: a pipe nobody reads while stdout streams would fill and block the child
    with tempfile.TemporaryFile(mode="w+") as errf:
        proc = subprocess.Popen(
            [str(py), str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            text=True,
            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
        )
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            if line.startswith("{"):
                yield json.loads(line)
        rc = proc.wait()
        errf.seek(0)
        err = errf.read()
    if rc != 0:
        log(f"  kvpress {job['press']} failed: {(err.strip().splitlines() or ['no output'])[-1][:300]}")
