"""Retrieval that does not flatter accumulated attention: a needle stated once in essay or
Wikipedia haystacks ("needle"), and RULER's variable tracking ("vartrack")."""

from __future__ import annotations

from ...data.needle_once import HAYSTACKS, haystack, needle_once_prompt
from ...data.vartrack import vartrack_prompt
from ..metrics import exact_match
from .base import GenerationTask, Sample


class _HaystackTask(GenerationTask):
    """Sample i: haystack kind varies fastest, then depth, then length (any n covers the grid)."""

    depths: tuple = (0.5,)

    def __init__(self, lengths=(1024,), depths=None, haystacks=HAYSTACKS, haystack_fn=None):
        self.lengths, self.haystacks = tuple(lengths), tuple(haystacks)
        if depths is not None:
            self.depths = tuple(depths)
        self.haystack_fn = haystack_fn or haystack  # tests pass a fixture

    def grid(self, i):
        K, D = len(self.haystacks), len(self.depths)
        return self.haystacks[i % K], self.depths[(i // K) % D], self.lengths[(i // (K * D)) % len(self.lengths)]


class NeedleOnceTask(_HaystackTask):
    """One "The access code for <subject> is <5 digits>." sentence at a depth of an essay or a
    Wikipedia haystack, asked for at the end; exact match."""

    name = "needle"
    metrics = {"em": "proportion"}
    primary = "em"
    max_new_tokens = 24
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)

    def samples(self, tokenizer, n):
        out = []
        for i in range(n):
            kind, depth, length = self.grid(i)
            p = needle_once_prompt(self.haystack_fn(kind, tokenizer, length - 40, i % 7), depth, seed=2000 + i)
            out.append(
                Sample(
                    id=f"{kind}-{length}-d{depth:g}-{i}",
                    data={"messages": p.messages, "answer": p.answer, "length": length, "depth": depth},
                )
            )
        return out

    def score(self, sample, text, reference_text):
        return {"em": exact_match(text, sample.data["answer"])}


class VarTrackTask(_HaystackTask):
    """RULER ``vt``: 2 chains of 4 assignments in filler; score = the fraction of the asked
    chain's variables named in the answer (RULER's string_match_all); em = all of them."""

    name = "vartrack"
    metrics = {"recall": "mean", "em": "proportion"}
    primary = "recall"
    max_new_tokens = 40

    def samples(self, tokenizer, n):
        out = []
        for i in range(n):
            kind, _, length = self.grid(i)
            p = vartrack_prompt(self.haystack_fn(kind, tokenizer, length - 120, i % 7), seed=3000 + i)
            out.append(
                Sample(id=f"{kind}-{length}-{i}", data={"messages": p.messages, "answers": p.answers, "length": length})
            )
        return out

    def score(self, sample, text, reference_text):
        found = [a in text for a in sample.data["answers"]]
        return {"recall": sum(found) / len(found), "em": float(all(found))}
