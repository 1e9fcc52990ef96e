"""Needle in a haystack with several keys (RULER's ``niah_multikey`` shape, Hsieh et al. 2024):
``n_keys`` labelled numbers hidden at spread depths; the question asks for one of them, so the
others are distractors the cache must not confuse with it."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .passkey import insert_at

LABELS = ["amber", "cobalt", "crimson", "jade", "ivory", "onyx", "scarlet", "violet"]


@dataclass
class NeedlePrompt:
    messages: list[dict]
    answer: str
    depth: float  # where the asked-for needle sits (0 = start, 1 = end)
    lead: str = ""  # the answer's first words, for a base model to complete (passkey.for_tokenizer)


def multikey_prompt(haystack: str, depth: float, n_keys: int = 4, seed: int = 0) -> NeedlePrompt:
    """Hide ``n_keys`` labelled 6-digit numbers; the asked-for one at ``depth``, the others spread
    evenly over the rest of the text. Exact match: the answer must appear in the output."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}.")
    if not 1 <= n_keys <= len(LABELS):
        raise ValueError(f"n_keys must be in [1, {len(LABELS)}], got {n_keys}.")
    rng = random.Random(seed)
    labels = rng.sample(LABELS, n_keys)
    values = [str(rng.randint(100000, 999999)) for _ in labels]
    others = [(i + 0.5) / (n_keys - 1) for i in range(n_keys - 1)] if n_keys > 1 else []
    depths = [depth] + others
    text = haystack
    # insert deepest first so earlier insertions do not shift the later depths
    for d, lab, val in sorted(zip(depths, labels, values), key=lambda x: -x[0]):
        text = insert_at(text, d, f" The special magic number for {lab} is {val}. ")
    question = (
        f"Some special magic numbers are hidden in the following text. Remember them.\n\n{text}\n\n"
        f"What is the special magic number for {labels[0]}? Answer with the number only."
    )
    return NeedlePrompt(
        messages=[{"role": "user", "content": question}],
        answer=values[0],
        depth=depth,
        lead=f"The special magic number for {labels[0]} is",
    )
