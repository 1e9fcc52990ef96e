"""104 full English Wikipedia articles from the ``gensim`` wheel's test data (a shortened
enwiki dump, wikitext markup), turned into plain text for perplexity on long real text."""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from ..fetch import wheel_members

REQUIREMENT = "gensim==4.4.0"
MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass
class Article:
    title: str
    text: str


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove balanced ``open_ ... close`` spans (templates and tables nest)."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth, i = depth + 1, i + len(open_)
        elif depth and text.startswith(close, i):
            depth, i = depth - 1, i + len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
_FILE = re.compile(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I)


def wikitext_to_text(markup: str) -> str:
    """Plain prose from wikitext: templates, tables, refs, files and categories dropped, links
    replaced by their label, bold/italic quotes and heading marks removed."""
    t = re.sub(r"<!--.*?-->", "", markup, flags=re.S)
    t = re.sub(r"<ref[^>]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    t = _strip_nested(t, "{{", "}}")
    t = _strip_nested(t, "{|", "|}")
    t = _FILE.sub("", t)
    t = _LINK.sub(r"\1", t)
    t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\]", "", t)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    t = re.sub(r"\n{3,}", "\n\n", t)
    return t.strip()


def parse_dump(stream) -> list[Article]:
    """Articles (namespace 0, not redirects) of a MediaWiki XML export stream."""
    out = []
    for _, el in ET.iterparse(stream):
        if not el.tag.endswith("}page") and el.tag != "page":
            continue
        ns = "{" + el.tag.split("}")[0][1:] + "}" if el.tag.startswith("{") else ""
        title, kind = el.findtext(f"{ns}title") or "", el.findtext(f"{ns}ns") or "0"
        raw = el.findtext(f"{ns}revision/{ns}text") or ""
        el.clear()
        if kind != "0" or el.find(f"{ns}redirect") is not None or raw.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = wikitext_to_text(raw)
        if text:
            out.append(Article(title=title, text=text))
    return out


def wikipedia(path=None, min_chars: int = 2000) -> list[Article]:
    """The articles of the gensim wheel's dump (or a .xml/.xml.bz2 at ``path``) with at least
    ``min_chars`` characters of text."""
    path = path or wheel_members(REQUIREMENT, MEMBER, "gensim-enwiki")[0]
    opener = bz2.open if str(path).endswith(".bz2") else open
    with opener(path, "rb") as fh:
        return [a for a in parse_dump(fh) if len(a.text) >= min_chars]
