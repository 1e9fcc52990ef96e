"""The house rules on the docs that a machine can check: every relative link resolves, the README
is short with code near its top, every ``kvevict.x.y`` named exists, and neither src/, the tests nor
the user docs name issues by number."""

import importlib
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


def test_no_issue_numbers_in_the_source_the_tests_or_the_user_docs():
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *DOCS]
    assert [str(f.relative_to(ROOT)) for f in files if ISSUE.search(f.read_text())] == []


# kvevict.x.y as the docs and docstrings write it; not inside a path (src/kvevict/...) or a longer name
DOTTED = re.compile(r"(?<![\w/.\-])kvevict(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"py", "md", "json", "cpp"}  # kvevict.spec.py: a file, written with dots


def _exists(name: str) -> bool:
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return (ROOT / "src" / "/".join(parts[:-1])).with_suffix("." + parts[-1]).exists()
    for i in range(len(parts), 0, -1):  # the longest prefix that imports, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_kvevict_name_in_the_docs_and_the_source_exists():
    stale = set()
    for path in [*DOCS, *sorted((ROOT / "src").rglob("*.py"))]:
        text = re.sub(r"https?://\S+", " ", path.read_text())
        stale |= {(str(path.relative_to(ROOT)), n) for n in DOTTED.findall(text) if not _exists(n)}
    assert sorted(stale) == []
