"""Retrieval under eviction: a pass key (Mohtashami & Jaggi, 2023) or several labelled needles
(RULER's multi-key needle in a haystack) hidden at a depth of an essay haystack; exact match."""

from __future__ import annotations

from ...data.needles import multikey_prompt
from ...data.passkey import for_tokenizer, passkey_prompt
from ..metrics import exact_match
from .base import GenerationTask, Sample


class RetrievalTask(GenerationTask):
    """Sample i: kind (single / multi-key) varies fastest, then depth, then length, so any n
    covers the grid evenly. The haystack is Paul Graham essays (or ``haystack_fn`` in tests)."""

    name = "passkey"
    metrics = {"em": "proportion"}
    primary = "em"
    max_new_tokens = 24  # the model often restates the question ("The special magic number for X is") first

    def __init__(
        self,
        lengths=(1024, 2048),
        depths=(0.0, 0.25, 0.5, 0.75, 1.0),
        kinds=("single", "multi"),
        n_keys: int = 4,
        haystack_fn=None,
    ):
        self.lengths, self.depths, self.kinds, self.n_keys = tuple(lengths), tuple(depths), tuple(kinds), n_keys
        self.haystack_fn = haystack_fn

    def _haystack(self, tokenizer, n_tokens, start):
        if self.haystack_fn is not None:
            return self.haystack_fn(tokenizer, n_tokens, start)
        from ...data.essays import haystack

        return haystack(tokenizer, n_tokens, start)

    def samples(self, tokenizer, n):
        out = []
        K, D = len(self.kinds), len(self.depths)
        for i in range(n):
            kind, depth = self.kinds[i % K], self.depths[(i // K) % D]
            length = self.lengths[(i // (K * D)) % len(self.lengths)]
            # the needle text takes ~20-60 tokens; the prompt is about `length` tokens in all
            hay = self._haystack(tokenizer, length - 40, start=i % 7)
            if kind == "single":
                p = passkey_prompt(hay, depth, seed=1000 + i)
            else:
                p = multikey_prompt(hay, depth, n_keys=self.n_keys, seed=1000 + i)
            out.append(
                Sample(
                    id=f"{kind}-{length}-d{depth:g}-{i}",
                    data={
                        "messages": for_tokenizer(p.messages, p.lead, tokenizer),
                        "answer": p.answer,
                        "kind": kind,
                        "length": length,
                        "depth": depth,
                    },
                )
            )
        return out

    def score(self, sample, text, reference_text):
        return {"em": exact_match(text, sample.data["answer"])}
