"""A grid item function: one passkey retrieval (a number hidden in long text, asked back) under
one policy and budget. Used by ``kvevict sweep`` and the executor tests; eval's tasks plug in the
same way (any ``fn(model, tokenizer, item) -> dict``)."""

from __future__ import annotations

# The passkey papers' filler (Mohtashami & Jaggi 2023, "Landmark Attention"): needs no download.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def haystack_text(tokenizer, kind: str, tokens: int) -> str:
    if kind == "essays":
        from ..data.essays import haystack

        return haystack(tokenizer, tokens)
    if kind == "filler":
        per = max(1, len(tokenizer(FILLER, add_special_tokens=False)["input_ids"]))
        return (FILLER * (tokens // per + 1)).strip()
    raise ValueError(f"unknown haystack {kind!r}: use essays or filler.")


def run(model, tokenizer, item: dict) -> dict:
    """item: policy, budget, tokens, depth, and optionally haystack ("essays" | "filler"),
    seed, max_new_tokens."""
    from ..data.passkey import passkey_prompt
    from ..generate import generate

    task = passkey_prompt(
        haystack_text(tokenizer, item.get("haystack", "essays"), int(item["tokens"])),
        float(item["depth"]),
        seed=int(item.get("seed", 0)),
    )
    r = generate(
        model,
        tokenizer,
        task.messages,
        item["policy"],
        item.get("budget"),
        max_new_tokens=int(item.get("max_new_tokens", 12)),
    )
    return {
        "answer": task.answer,
        "text": r.text,
        "found": task.answer in r.text,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": r.new_tokens,
        "kv_bytes": r.kv_bytes,
        "full_kv_bytes": r.full_kv_bytes,
        "seconds": round(r.seconds, 3),
    }
