"""XSum summarization under eviction (H2O and RoCo papers): ROUGE-1/2/L against the reference
summary, and ROUGE-L against the full cache's own summary (how far eviction moves the output)."""

from __future__ import annotations

from ..metrics import rouge
from .base import GenerationTask, Sample


class XSumTask(GenerationTask):
    name = "xsum"
    metrics = {"rouge1": "mean", "rouge2": "mean", "rougeL": "mean", "rougeL_vs_full": "mean"}
    primary = "rougeL"
    asks_last = False  # the instruction comes first: no question to read apart
    max_new_tokens = 48
    uses_reference = True

    def __init__(self, max_chars: int = 3000, items=None):
        self.max_chars, self._items = max_chars, items

    def samples(self, tokenizer, n):
        if self._items is None:
            from ...data.xsum import xsum

            self._items = xsum()
        items = [it for it in self._items if len(it.document) <= self.max_chars][:n]
        return [
            Sample(
                id=it.id,
                data={
                    "messages": [
                        {
                            "role": "user",
                            "content": f"Summarize the following article in one sentence.\n\n{it.document}",
                        }
                    ],
                    "reference": it.summary,
                },
            )
            for it in items
        ]

    def score(self, sample, text, reference_text):
        s = rouge(text, sample.data["reference"])
        s["rougeL_vs_full"] = rouge(text, reference_text)["rougeL"] if reference_text is not None else float("nan")
        return s
