"""benchmarks/compress_ask.py: the facts it hides and the questions that ask them, its ratio
arithmetic against hand-computed values, and one run on a tiny model for the shape of its output
and its arms' answers (never for speed: speed lives in the bench's own output)."""

import json

import pytest
from benchmarks.compress_ask import build_facts, cache_kwargs, ratio_summary, run, table

from conftest import tiny_model
from eval_helpers import essay_like, tiny_tokenizer


def test_facts_are_hidden_once_each_at_their_depths():
    hay = "Plain words go here. " * 200
    context, facts = build_facts(hay, seed=3)
    assert len(facts) == 4 and len({f["value"] for f in facts}) == 4 and len({f["label"] for f in facts}) == 4
    where = [context.index(f"magic number for {f['label']} is {f['value']}.") for f in facts]
    assert where == sorted(where)  # depths 0.2 .. 0.8 in order
    for f, at in zip(facts, where):
        assert context.count(f["value"]) == 1
        assert abs(at / len(context) - f["depth"]) < 0.05
        assert f["label"] in f["question"] and f["value"] not in f["question"]
    _, led = build_facts(hay, seed=3, lead=True)
    assert led[0]["question"].endswith(f"The special magic number for {facts[0]['label']} is")
    with pytest.raises(ValueError, match="n_facts"):
        build_facts(hay, n_facts=5)


def test_ratio_is_the_median_of_per_round_ratios():
    # rounds: 0.1/1.0, 0.3/2.0, 0.2/0.5 -> ratios 0.1, 0.15, 0.4: median 0.15 (not 0.2 / 1.0)
    s = ratio_summary([1.0, 2.0, 0.5], [0.1, 0.3, 0.2])
    assert s == {"full_s": 1.0, "fork_s": 0.2, "ratio": pytest.approx(0.15)}
    with pytest.raises(ValueError):
        ratio_summary([1.0], [])


def test_cache_arguments():
    assert cache_kwargs(None, 0.2) == ((), {"memory": 0.2})
    assert cache_kwargs("h2o/int4@0.2", 0.2) == (("h2o/int4@0.2",), {})
    with pytest.raises(ValueError, match="--memory"):
        cache_kwargs(None, 0.0)


def test_a_context_kept_whole_answers_as_the_full_recompute(tmp_path):
    """``full``: the fork's answers are the stock cache's, so the target's answer half holds; a
    budgeted run has the same shape, its context held at the budget's share."""
    model, tok = tiny_model(), tiny_tokenizer()
    context, facts = build_facts(essay_like(tok, 120), seed=1)
    res = run(model, tok, context, facts[:2], "full", 0.2, rounds=2, max_new=4)
    for r in res["rows"]:
        assert r["once"]["text"] == r["full"]["text"]
        assert len(r["ttft"]["rounds_full_s"]) == len(r["ttft"]["rounds_fork_s"]) == 2
        assert r["question_tokens"] > 0
    assert len(res["compress_s"]) == 2 and res["kv_share"] > 0.99
    res = run(model, tok, context, facts[:2], "h2o@0.25", 0.2, rounds=1, max_new=4)
    kept, _, seen = res["storage"].split(", ")[1].partition(" of ")
    assert int(kept) == pytest.approx(0.25 * res["context_tokens"], abs=1) and res["policy"] == "h2o@0.25"
    assert seen == f"{res['context_tokens']} tokens"
    assert all(r["per_question"]["policy"] == "h2o@0.25" for r in res["rows"])
    res.update(model="tiny", dtype="float32", threads=1, rounds=1, command="x")
    md = table(res)
    assert md.count("\n| ") == 2 + 1 and "target (each question's TTFT <= 0.25x" in md
    json.dumps({k: v for k, v in res.items()})  # the JSON main writes


def test_compress_cost_rows_are_against_the_prefill():
    """benchmarks/compress_cost.py: one row per arm, the prefill first at 1x, each rep kept."""
    from benchmarks.compress_cost import PREFILL, arms, measure
    from benchmarks.compress_cost import table as cost_table

    model, tok = tiny_model(), tiny_tokenizer()
    ids = tok(essay_like(tok, 60), return_tensors="pt")["input_ids"]
    calls = arms(model, tok, ids, ["h2o", "knorm"], 0.2)
    assert calls["knorm"]().label == "knorm"  # each arm compresses with its own policy
    rows = measure(calls, reps=2)
    assert [r["arm"] for r in rows] == [PREFILL, "h2o", "knorm"]
    assert rows[0]["cpu_vs_prefill"] == 1.0 and all(len(r["runs"]) == 2 for r in rows)
    res = {"context_tokens": ids.shape[1], "model": "tiny", "dtype": "float32", "threads": 1, "memory": 0.2}
    assert cost_table({**res, "reps": 2, "rows": rows}).count("\n| ") == 1 + 3
    with pytest.raises(ValueError, match="--reps"):
        measure(calls, reps=0)
