"""PIQA log-likelihood accuracy (lm-eval-harness style) as a cheap regression check: each
solution is scored as a continuation of "Question: {goal}\\nAnswer:" under the cell's cache; acc
picks the higher sum log p, acc_norm the higher sum log p per character of the solution."""

from __future__ import annotations

import time

import torch

from ..streaming import continuation_logprob
from .base import Sample, Task


class PIQATask(Task):
    name = "piqa"
    metrics = {"acc": "proportion", "acc_norm": "proportion"}
    primary = "acc_norm"

    def __init__(self, items=None):
        self._items = items

    def samples(self, tokenizer, n):
        if self._items is None:
            from ...data.piqa import piqa

            self._items = piqa()
        return [
            Sample(id=it.id, data={"goal": it.goal, "options": it.options, "label": it.label}) for it in self._items[:n]
        ]

    def evaluate(self, model, tokenizer, sample, cells, reference):
        ctx = tokenizer(f"Question: {sample.data['goal']}\nAnswer:", add_special_tokens=False, return_tensors="pt")[
            "input_ids"
        ]
        conts = [
            tokenizer(" " + o, add_special_tokens=False, return_tensors="pt")["input_ids"]
            for o in sample.data["options"]
        ]
        out = {}
        for policy, budget in cells:
            t0 = time.perf_counter()
            lps = [continuation_logprob(model, ctx, c, policy, budget) for c in conts]
            norm = [lp / max(1, len(o)) for lp, o in zip(lps, sample.data["options"])]
            label = sample.data["label"]
            out[(policy, budget)] = {
                "scores": {
                    "acc": float(int(torch.tensor(lps).argmax()) == label),
                    "acc_norm": float(int(torch.tensor(norm).argmax()) == label),
                },
                "output": None,
            }
            out[(policy, budget)]["seconds"] = round(time.perf_counter() - t0, 3)
            self._done((policy, budget), out[(policy, budget)])
        return out
