"""What a task is: a list of samples, and a way to score one sample under several grid cells
(policy, budget) at once, so that work shared by the cells (the full-cache reference) is done once."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import ClassVar

from ...generate import generate
from ..apart import answer_apart, split_label
from ..caches import FULL, memory_cell, memory_spec


@dataclass
class Sample:
    id: str
    data: dict


Cell = tuple  # (policy name, budget); ("full", None) is the reference


class Task:
    name: ClassVar[str] = "base"
    # metric -> aggregation kind (see intervals.aggregate): 'mean', 'proportion' or 'exp'
    metrics: ClassVar[dict[str, str]] = {}
    primary: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    # called as on_cell(cell, result) as soon as a cell is scored, so the runner can write it at
    # once (a killed run loses at most one cell) and print progress
    on_cell = None

    def _done(self, cell, result: dict) -> None:
        if self.on_cell is not None:
            self.on_cell(cell, result)

    def samples(self, tokenizer, n: int) -> list[Sample]:
        raise NotImplementedError

    def evaluate(self, model, tokenizer, sample: Sample, cells: list[Cell], reference: dict | None):
        """{cell: {"scores": {metric: value}, "output": str | None}} for each cell. ``reference`` is
        the already written full-cache record of this sample, if any (its output, for tasks that
        compare with it)."""
        raise NotImplementedError


class GenerationTask(Task):
    """A chat prompt answered greedily under each cell; ``score`` compares the answer."""

    max_new_tokens: int = 32
    uses_reference: bool = False  # True: score() also gets the full cache's answer
    # whether the prompt ends with its question (its last paragraph), so ``--question apart`` can
    # compress the context before it (``kvevict.eval.apart``); an instruction first (xsum): False
    asks_last: ClassVar[bool] = True

    def prompt(self, sample: Sample) -> list[dict]:
        raise NotImplementedError

    def score(self, sample: Sample, text: str, reference_text: str | None) -> dict:
        raise NotImplementedError

    def max_new(self, sample: Sample, tokenizer) -> int:
        return self.max_new_tokens

    def evaluate(self, model, tokenizer, sample, cells, reference):
        ref_text = reference["output"] if reference else None
        order = sorted(cells, key=lambda c: c[0] != FULL)  # the reference first
        if self.uses_reference and ref_text is None and order[0][0] != FULL:
            order = [(FULL, None)] + order
        out, recorded = {}, {}
        prompt = sample.data["messages"] if "messages" in sample.data else self.prompt(sample)
        for cell in order:
            policy, budget = cell
            max_new = self.max_new(sample, tokenizer)
            base, apart = split_label(policy)
            if apart:  # the context compressed alone, the question read after it
                res = answer_apart(model, tokenizer, prompt, sample, (base, budget), max_new, recorded)
            else:
                res = _generate_cell(model, tokenizer, prompt, policy, budget, max_new, recorded)
            if policy == FULL:
                ref_text = res.text
            out[cell] = {
                "scores": self.score(sample, res.text, ref_text),
                "output": res.text,
                "prompt_tokens": res.prompt_tokens,
                "kv_bytes": res.kv_bytes,
                "full_kv_bytes": res.full_kv_bytes,
                "seconds": round(res.seconds, 3),
            }
            if cell in cells:
                self._done(cell, out[cell])
        return {c: r for c, r in out.items() if c in cells}


def _generate_cell(model, tokenizer, prompt, policy, budget, max_new, recorded: dict):
    """One cell's answer. ``mem`` / ``mem-NAME`` cells give ``budget`` as a memory budget (a share of
    a 16-bit stock cache: ``generate(memory=budget)``, the policy picked or NAME). A policy that
    scores the prompt in a pass of its own (kvzip) records it once per sample in ``recorded``, shared
    by the cells of that sample (its scores do not depend on the budget); each cell's time still
    includes the recording."""
    from ...policies import policy_class

    memory, bits = None, {}
    if memory_spec(policy):
        memory = budget
        policy, bits = memory_cell(
            policy, prompt_known=True, model=model, share=budget
        )  # "mem-kvzip-pool/int4": the bytes at int4
    found = policy_class(policy)
    if found is None or not found[0].needs_prompt:
        return generate(model, tokenizer, prompt, policy, budget, max_new, memory=memory, **bits)
    if policy not in recorded:
        from ...generate import encode_chat

        t0 = time.perf_counter()
        recorded[policy] = (
            found[0].record(model, tokenizer, encode_chat(tokenizer, prompt), **found[1]),
            time.perf_counter() - t0,
        )
    rec, seconds = recorded[policy]
    res = generate(model, tokenizer, prompt, rec, budget, max_new, memory=memory, **bits)
    return dataclasses.replace(res, policy=policy, seconds=res.seconds + seconds)
