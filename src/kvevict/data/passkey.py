"""Passkey retrieval: a number hidden at a chosen depth of long filler text."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PasskeyPrompt:
    messages: list[dict]
    answer: str
    lead: str = "The pass key is"  # the answer's first words, for a base model to complete
    text: str = ""  # the haystack with the key in it, without the question (a base model's completion form)


def for_tokenizer(messages: list[dict], lead: str, tokenizer) -> list[dict]:
    """The messages as they are for a chat model; for a base model (no chat template) followed by
    the answer's first words as an assistant message, which kvevict.generate's plain-text prompt
    ends with, so the model completes the answer instead of going on with the text (Mohtashami &
    Jaggi's pass key prompt ends "The pass key is" the same way)."""
    if getattr(tokenizer, "chat_template", None):
        return messages
    return [*messages, {"role": "assistant", "content": lead}]


def insert_at(text: str, depth: float, needle: str) -> str:
    """``needle`` put at ``depth`` of ``text`` (0 = start, 1 = end), moved back to a sentence end."""
    if depth >= 1.0:
        return text + needle
    cut = text.rfind(". ", 0, int(len(text) * depth))
    at = cut + 1 if cut > 0 else 0
    return text[:at] + needle + text[at:]


def passkey_prompt(haystack: str, depth: float, seed: int = 0) -> PasskeyPrompt:
    """Hide a 5-digit pass key at ``depth`` (0 = start, 1 = end) of ``haystack``, at a paragraph or
    sentence boundary, and ask for it as a chat message."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}.")
    key = str(random.Random(seed).randint(10000, 99999))
    text = insert_at(haystack, depth, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = (
        "There is a pass key hidden in the following text. Find it and remember it.\n\n"
        f"{text}\n\nWhat is the pass key? Answer with the number only."
    )
    return PasskeyPrompt(messages=[{"role": "user", "content": question}], answer=key, text=text)
