"""Next token per sequence: greedy at temperature 0, else temperature + nucleus (top-p) sampling
(Holtzman et al. 2020: sample from the smallest set of tokens whose probability reaches p)."""

from __future__ import annotations

import torch


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator=None) -> int:
    """logits: (vocab,) of one sequence."""
    if temperature <= 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the token that crosses p stays in
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def pick_tokens(logits: torch.Tensor, how: list[tuple]) -> list[int]:
    """Next token of every row of ``logits`` (rows, vocab); ``how``: (temperature, top_p, generator)
    per row. Greedy rows cost one host transfer for the whole batch, not one per row."""
    greedy = logits.argmax(-1).tolist()
    return [g if t <= 0.0 else next_token(row, t, p, gen) for g, row, (t, p, gen) in zip(greedy, logits, how)]
