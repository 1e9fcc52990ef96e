"""Token log-probabilities from the logits a step already computed, and their OpenAI layouts.

What they are: ``log_softmax`` of the model's raw logits at that position, before temperature and
top-p (vLLM's default, ``raw_logprobs``; OpenAI's ``logprobs`` are likewise the model's, whatever
the sampling settings). So a sampled request reports the model's distribution, and greedy ones
the same numbers a direct forward gives. With a budgeted cache they are what that cache computes:
each generated token's come from logits over the tokens its row kept. ``top_logprobs`` are the k
most likely tokens at that position (the sampled one need not be among them, as at OpenAI).

Entries: ``(token_id, logprob or None, [(top_id, top_logprob), ...])``, one per token; the first
prompt token of an echo has no logprob (nothing precedes it), as at OpenAI.
"""

from __future__ import annotations

import torch

MAX_TOP = 20  # the most top_logprobs a request may ask for (OpenAI chat's limit; vLLM's default)


def token_entries(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[tuple]:
    """One entry per row of ``logits`` (rows, vocab): the logprob of that row's token in ``tokens``
    and its ``tops[i]`` most likely tokens. One log_softmax and one top-k for all rows, one host
    read each."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    values, ids = lp.topk(k, dim=-1) if k else (None, None)
    values, ids = (values.tolist(), ids.tolist()) if k else ([[]] * len(tokens), [[]] * len(tokens))
    return [(t, c, list(zip(i[:n], v[:n]))) for t, c, i, v, n in zip(tokens, chosen, ids, values, tops)]


def prompt_entries(logits: torch.Tensor, prompt: list[int], top: int) -> list[tuple]:
    """Entries of a prompt's tokens from one row's logits at every position (positions, vocab),
    the prompt right-aligned in them (left padding before it): token j's come from position j - 1."""
    start = logits.shape[0] - len(prompt)
    rest = token_entries(logits[start : start + len(prompt) - 1], prompt[1:], [top] * (len(prompt) - 1))
    return [(prompt[0], None, [])] + rest


class Layout:
    """Entries -> OpenAI's shapes, with each token's text (``decode([id])``, special tokens kept
    so an EOS shows; a token that is part of a multi-byte character shows U+FFFD, its ``bytes``
    those of that text)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._text = tokenizer, {}

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def chat(self, entries: list[tuple]) -> dict:
        """``choice.logprobs`` of /v1/chat/completions: ``{"content": [...]}``."""

        def one(t, lp):
            s = self.text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]}

    def completion(self, entries: list[tuple], offset: int = 0) -> dict:
        """``choice.logprobs`` of /v1/completions: parallel lists; ``text_offset`` counts characters
        of the returned text (the echoed prompt's tokens first), from ``offset``."""
        tokens = [self.text(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if lp is None else self._top(top) for _, lp, top in entries],
            "text_offset": offsets,
        }

    def _top(self, top: list[tuple]) -> dict:
        out = {}
        for i, v in top:  # two ids with one text (U+FFFD): the likelier one's value, as listed first
            out.setdefault(self.text(i), v)
        return out
