"""A needle stated once (one sentence, never repeated) in haystacks of more than one kind, and
the haystacks themselves. The library's pass key states the key twice ("... is X. Remember it. X
is ..."), which flatters scores that accumulate attention; this one does not."""

from __future__ import annotations

import random
from functools import lru_cache

from .passkey import PasskeyPrompt, insert_at

HAYSTACKS = ("essays", "wikipedia")
SUBJECTS = [
    "the north gate",
    "the archive room",
    "the server rack",
    "the blue locker",
    "the east tunnel",
    "the backup vault",
    "the radio mast",
    "the pump station",
]


@lru_cache(maxsize=1)
def _wikipedia_text() -> str:
    from .wikipedia import wikipedia

    return "\n\n".join(a.text for a in wikipedia())


def haystack(kind: str, tokenizer, n_tokens: int, start: int = 0) -> str:
    """About ``n_tokens`` tokens of ``kind`` text (essays: Paul Graham; wikipedia: encyclopaedic,
    technical articles), starting at the ``start``-th piece, cut at a sentence end."""
    if kind == "essays":
        from .essays import haystack as essay_haystack

        return essay_haystack(tokenizer, n_tokens, start)
    if kind != "wikipedia":
        raise ValueError(f"unknown haystack {kind!r}; known: {', '.join(HAYSTACKS)}.")
    text = _wikipedia_text()
    at = (start * 7919 * 61) % max(1, len(text) - n_tokens * 8)  # a different stretch per start
    at = text.find(". ", at) + 2
    ids = tokenizer(text[at : at + n_tokens * 8], add_special_tokens=False)["input_ids"][:n_tokens]
    cut = tokenizer.decode(ids)
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else cut


def needle_once_prompt(text: str, depth: float, seed: int = 0) -> PasskeyPrompt:
    """One sentence "The access code for <subject> is <5 digits>." at ``depth`` of ``text``,
    asked for at the end of the prompt."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}.")
    rng = random.Random(seed)
    subject, code = rng.choice(SUBJECTS), str(rng.randint(10000, 99999))
    body = insert_at(text, depth, f" The access code for {subject} is {code}. ")
    question = (
        f"Read the following text.\n\n{body}\n\nWhat is the access code for {subject}? Answer with the number only."
    )
    return PasskeyPrompt(messages=[{"role": "user", "content": question}], answer=code)
