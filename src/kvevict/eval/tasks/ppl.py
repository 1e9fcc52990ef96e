"""Perplexity and next-token agreement on long real text, with the policy evicting as the text
streams in (H2O paper, streaming language modelling; RoCo paper, language modelling)."""

from __future__ import annotations

import math

import torch

from ..caches import memory_spec
from ..streaming import stream_compare
from .base import Sample, Task

SOURCES = ("wikipedia", "essays", "austen")


def source_texts(source: str) -> list[str]:
    """Long texts of one source, in a fixed order (each at least a few thousand characters)."""
    if source == "wikipedia":
        from ...data.wikipedia import wikipedia

        return [a.text for a in wikipedia()]
    if source == "essays":
        from ...data.essays import essays

        es = essays()
        # essays are 1-5K tokens: window k starts at essay k and runs on into the next ones
        return ["\n\n".join(es[k:] + es[:k]) for k in range(len(es))]
    if source == "austen":
        from ...data.austen import austen

        # a window per novel and per quarter of it, so six novels give 24 distinct windows
        return [t[len(t) * q // 4 :] for q in range(4) for _, t in austen()]
    raise ValueError(f"unknown text source {source!r}; known: {', '.join(SOURCES)}.")


class PerplexityTask(Task):
    """Samples are windows of ``tokens`` tokens, cycling over the sources. Budgets are a fraction
    of the window (an int budget: that many tokens). Scores, over every predicted token:
    nll (mean -log p; the summary reports perplexity = exp(mean nll)), nll_late (the same over
    the second half of the window, where eviction has had time to bite), top1 (argmax = the full
    cache's argmax) and kl (KL(full || policy), nats)."""

    name = "ppl"
    metrics = {"nll": "exp", "nll_late": "exp", "top1": "mean", "kl": "mean"}
    primary = "nll"
    higher_is_better = False

    def __init__(self, tokens: int = 1024, chunk: int = 32, sources=SOURCES, texts=None):
        self.tokens, self.chunk, self.sources = tokens, chunk, tuple(sources)
        self._texts = texts  # {source: [text, ...]}: tests pass fixtures

    def _texts_of(self, source):
        if self._texts is not None:
            return self._texts[source]
        return source_texts(source)

    def samples(self, tokenizer, n):
        out, per_source = [], {s: self._texts_of(s) for s in self.sources}
        cursor = {s: 0 for s in self.sources}
        i = 0
        while len(out) < n and any(cursor[s] < len(per_source[s]) for s in self.sources):
            src = self.sources[i % len(self.sources)]
            i += 1
            texts = per_source[src]
            while cursor[src] < len(texts):
                k = cursor[src]
                cursor[src] += 1
                ids = tokenizer(texts[k][: self.tokens * 12], add_special_tokens=False)["input_ids"]
                if len(ids) >= self.tokens:
                    out.append(Sample(id=f"{src}-{k}-{self.tokens}", data={"ids": ids[: self.tokens]}))
                    break
        return out

    def evaluate(self, model, tokenizer, sample, cells, reference):
        ids = torch.tensor([sample.data["ids"]])
        n = ids.shape[1]
        # a float budget is a fraction of the whole window (make_cache would take it of the first chunk);
        # a memory cell's share is fixed against the window by stream_compare (set_prompt_length)
        resolved = [
            (p, b if b is None or isinstance(b, int) or memory_spec(p) else max(1, math.ceil(b * n))) for p, b in cells
        ]
        scores = stream_compare(model, ids, resolved, self.chunk)
        half = (n - 1) // 2
        out = {}
        for cell, rcell in zip(cells, resolved):
            sc = scores[rcell]
            nll = sum(sc.nll) / len(sc.nll)
            late = sc.nll[half:]
            out[cell] = {
                "scores": {
                    "nll": nll,
                    "nll_late": sum(late) / len(late),
                    "top1": sum(sc.top1) / len(sc.top1),
                    "kl": sum(sc.kl) / len(sc.kl),
                },
                "output": None,
                "tokens": n,
                "budget_tokens": rcell[1],
                "kv_bytes": sc.kv_bytes,
                "full_kv_bytes": sc.full_kv_bytes,
            }
        return out
