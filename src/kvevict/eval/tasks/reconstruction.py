"""Context reconstruction (the RoCo paper's task): the model is asked to repeat its context word
for word; BLEU of the repetition against the context. Eviction shows up as dropped or garbled
spans. Passages: the first sentences of XSum documents (from the end of the set, so that they do
not overlap the summarization samples)."""

from __future__ import annotations

from ..metrics import bleu
from .base import GenerationTask, Sample


class ReconstructionTask(GenerationTask):
    name = "reconstruct"
    metrics = {"bleu": "mean"}
    primary = "bleu"
    asks_last = False  # the instruction comes first: no question to read apart

    def __init__(self, tokens: int = 160, items=None):
        self.tokens, self._items = tokens, items

    def samples(self, tokenizer, n):
        if self._items is None:
            from ...data.xsum import xsum

            self._items = xsum()
        out = []
        for it in reversed(self._items):
            if len(out) >= n:
                break
            ids = tokenizer(it.document, add_special_tokens=False)["input_ids"]
            if len(ids) < self.tokens:
                continue
            cut = tokenizer.decode(ids[: self.tokens])
            end = max(cut.rfind(". "), cut.rfind(".\n"))
            passage = cut[: end + 1] if end > 0 else cut
            out.append(
                Sample(
                    id=it.id,
                    data={
                        "messages": [
                            {
                                "role": "user",
                                "content": "Repeat the following text exactly, word for word, and nothing else.\n\n"
                                + passage,
                            }
                        ],
                        "passage": passage,
                        "passage_tokens": len(tokenizer(passage, add_special_tokens=False)["input_ids"]),
                    },
                )
            )
        return out

    def max_new(self, sample, tokenizer):
        return sample.data["passage_tokens"] + 16

    def score(self, sample, text, reference_text):
        return {"bleu": bleu(text, sample.data["passage"])}
