"""The retrieval tasks (needle stated once, variable tracking) and the kvpress peer's
checks: generators against their definitions, scoring, errors."""

import re

import pytest

from eval_helpers import essay_like, tiny_tokenizer
from kvevict.data.needle_once import needle_once_prompt
from kvevict.data.vartrack import vartrack_prompt
from kvevict.eval.peer_kvpress import press_names
from kvevict.eval.tasks import NeedleOnceTask, VarTrackTask, task_names

HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 20


def test_the_needle_is_stated_once_at_its_depth():
    for depth in (0.0, 0.5, 1.0):
        p = needle_once_prompt(HAY, depth, seed=3)
        text = p.messages[0]["content"]
        assert text.count(p.answer) == 1  # once: no restatement to flatter accumulated attention
        body = text.split("\n\n")[1]
        at = body.index(p.answer) / len(body)
        assert abs(at - depth) < 0.1
        subject = re.search(r"access code for (.+?) is", body).group(1)
        assert text.endswith(f"What is the access code for {subject}? Answer with the number only.")


def test_variable_tracking_chain_leads_from_the_value_to_every_answer():
    p = vartrack_prompt(HAY, n_hops=4, n_chains=2, seed=1)
    text = p.messages[0]["content"]
    value = re.search(r"assigned the value (\d+) in the text", text).group(1)
    assign = dict(re.findall(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\.", text))
    assert len(assign) == 8
    holds = {v for v, src in assign.items() if src == value}
    while True:  # follow the chain: a variable holds the value if its source does
        more = {v for v, src in assign.items() if src in holds} - holds
        if not more:
            break
        holds |= more
    assert holds == set(p.answers) and len(p.answers) == 4
    order = [text.index(f"VAR {v} ") for v in p.answers]
    assert order == sorted(order)  # every assignment comes after its source


def test_tasks_sample_the_grid_and_score():
    tok = tiny_tokenizer()
    t = NeedleOnceTask(
        lengths=(96,),
        depths=(0.0, 1.0),
        haystacks=("a", "b"),
        haystack_fn=lambda kind, tk, n, start: essay_like(tk, n, start),
    )
    ids = [s.id for s in t.samples(tok, 4)]
    assert ids == ["a-96-d0-0", "b-96-d0-1", "a-96-d1-2", "b-96-d1-3"]
    s = t.samples(tok, 1)[0]
    assert t.score(s, f"It is {s.data['answer']}.", None) == {"em": 1.0}
    v = VarTrackTask(lengths=(96,), haystacks=("a",), haystack_fn=lambda kind, tk, n, start: essay_like(tk, n, start))
    s = v.samples(tok, 1)[0]
    a = s.data["answers"]
    assert v.score(s, f"{a[0]} and {a[2]}", None) == {"recall": 0.5, "em": 0.0}
    assert v.score(s, " ".join(a), None) == {"recall": 1.0, "em": 1.0}
    assert task_names("needle,vartrack") == ["needle", "vartrack"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: needle_once_prompt(HAY, 1.5), "depth must be in"),
        (lambda: vartrack_prompt(HAY, n_hops=0), "n_hops and n_chains must be >= 1"),
        (lambda: press_names("snapkv,h2o"), "unknown kvpress press 'h2o'"),
        (lambda: NeedleOnceTask(lengths=(96,), haystacks=("poems",)).samples(tiny_tokenizer(), 1), "unknown haystack"),
    ],
)
def test_bad_task_parameters_are_clear(make, message):
    with pytest.raises(ValueError, match=message):
        make()
