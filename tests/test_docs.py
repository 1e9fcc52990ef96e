"""The house rules on the docs that a machine can check: every relative link resolves, the README
is short with code near its top, and neither src/ nor the user docs name issues by number."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
ISSUE = re.compile(r"\bissues? #?\d+\b|\(#\d+\)", re.I)


def _anchors(path: Path) -> set:
    heads = re.findall(r"^#+\s+(.*)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
            bad.append(target)
    assert bad == []


def test_the_readme_is_short_and_shows_code_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    assert any(line.startswith("```") for line in lines[:60])


def test_no_issue_numbers_in_the_source_or_the_user_docs():
    files = [*(ROOT / "src").rglob("*.py"), *DOCS]
    assert [str(f.relative_to(ROOT)) for f in files if ISSUE.search(f.read_text())] == []
