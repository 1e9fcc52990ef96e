"""NarrativeQA under eviction: a story summary, a question, a short answer; token F1 against
the two references (max), as in the RoCo paper's QA evaluation."""

from __future__ import annotations

from ..metrics import token_f1
from .base import GenerationTask, Sample


class NarrativeQATask(GenerationTask):
    name = "narrativeqa"
    metrics = {"f1": "mean"}
    primary = "f1"
    max_new_tokens = 24

    def __init__(self, max_chars: int = 5000, items=None):
        self.max_chars, self._items = max_chars, items

    def samples(self, tokenizer, n):
        if self._items is None:
            from ...data.narrativeqa import narrativeqa

            self._items = narrativeqa()
        out, seen = [], set()
        for it in self._items:  # one question per story, for variety
            if len(out) >= n:
                break
            if it.passage in seen or len(it.passage) > self.max_chars:
                continue
            seen.add(it.passage)
            out.append(
                Sample(
                    id=it.id,
                    data={
                        "messages": [
                            {
                                "role": "user",
                                "content": f"Read the story and answer the question in a few words.\n\nStory: {it.passage}\n\n"
                                f"Question: {it.question}",
                            }
                        ],
                        "answers": it.answers,
                    },
                )
            )
        return out

    def score(self, sample, text, reference_text):
        return {"f1": token_f1(text, sample.data["answers"])}
