"""Each data loader against a small fixture in tests/fixtures (no download)."""

import pytest

from eval_helpers import FIXTURES
from kvevict.data import narrativeqa, needles, piqa, wikipedia, xsum


def test_wikipedia_parses_articles_and_cleans_markup():
    arts = wikipedia.wikipedia(FIXTURES / "enwiki-tiny.xml.bz2", min_chars=10)
    # the redirect and the Talk page are dropped
    assert [a.title for a in arts] == ["Lighthouse", "Tide"]
    text = arts[0].text
    assert text.startswith("A lighthouse is a tower that emits light signals to guide ships.")
    for junk in ("{{", "[[", "'''", "<ref", "Smith", "==", "wikitable", "Category", "Pharos", "http"):
        assert junk not in text, junk
    assert "History\nEarly lighthouses burned wood." in text
    assert "Fires were lit on hills." in text and "the keepers' site" in text
    assert arts[1].text == "Tides are the rise and fall of sea levels caused by the Moon."
    assert wikipedia.wikipedia(FIXTURES / "enwiki-tiny.xml.bz2", min_chars=100) == arts[:1]


def test_nested_templates_are_removed():
    assert wikipedia.wikitext_to_text("a {{outer|{{inner}}|x}} b") == "a  b"


def test_xsum_loader():
    items = xsum.xsum(FIXTURES / "xsum-tiny.jsonl")
    assert [i.id for i in items] == ["1", "3"]  # the empty document is skipped
    assert items[0].summary.startswith("A village fair")
    assert "two thousand people" in items[0].document


def test_narrativeqa_loader():
    items = narrativeqa.narrativeqa(FIXTURES / "narrativeqa-tiny.jsonl")
    assert len(items) == 2  # the item without answers is skipped
    assert items[0].answers == ["Old Tom", "Tom the keeper"]
    assert items[1].question == "What does Tom light every night?"


def test_piqa_loader_reads_options_and_label():
    items = piqa.piqa(FIXTURES / "piqa-tiny.jsonl")
    assert len(items) == 2  # the unlabelled item is skipped
    assert items[0].options == [
        "Stuff them with newspaper and leave them in a warm room.",
        "Stuff them with ice and leave them in the freezer.",
    ]
    assert items[0].label == 0 and items[1].label == 1
    assert items[1].options[1] == "can hold coffee"


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multikey_needles_are_all_hidden_and_asked_one_is_at_depth(depth):
    hay = "".join(f"Sentence number {i} is here. " for i in range(200))
    p = needles.multikey_prompt(hay, depth, n_keys=4, seed=3)
    text = p.messages[0]["content"]
    assert text.count("The special magic number for") == 4
    asked = text.rsplit("What is the special magic number for ", 1)[1].split("?")[0]
    at = text.index(f"The special magic number for {asked} is {p.answer}.")
    body_start = text.index("Sentence number 0")
    body_end = text.rindex("is here.")
    rel = (at - body_start) / (body_end - body_start)
    assert abs(rel - depth) < 0.08
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            needles.multikey_prompt(hay, bad)


def test_austen_reads_an_r_lazyload_database():
    from kvevict.data.austen import austen, lines_to_text

    books = austen(FIXTURES / "austen")
    assert books == [
        ("tinynovel", "Tiny Novel\n\nChapter 1\n\nIt was a bright cold day.\n\nThe end."),
        ("second", "Another book."),
    ]
    assert lines_to_text(["", "a", "b", "", "", "c"]) == "a b\n\nc"
