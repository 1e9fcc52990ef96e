"""Passkey retrieval: a number hidden at a chosen depth of long filler text."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PasskeyPrompt:
    messages: list[dict]
    answer: str


def passkey_prompt(haystack: str, depth: float, seed: int = 0) -> PasskeyPrompt:
    """Hide a 5-digit pass key at ``depth`` (0 = start, 1 = end) of ``haystack``, at a paragraph or
    sentence boundary, and ask for it as a chat message."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}.")
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    at = int(len(haystack) * depth)
    cut = haystack.rfind(". ", 0, at)
    at = cut + 1 if cut > 0 and depth < 1.0 else (len(haystack) if depth >= 1.0 else 0)
    text = haystack[:at] + needle + haystack[at:]
    question = ("There is a pass key hidden in the following text. Find it and remember it.\n\n"
                f"{text}\n\nWhat is the pass key? Answer with the number only.")
    return PasskeyPrompt(messages=[{"role": "user", "content": question}], answer=key)
