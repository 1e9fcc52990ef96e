"""RULER's needle tasks made offline by lm-eval's generator, and the eval grid's memory cells."""

import json

import pytest

from conftest import tiny_model
from eval_helpers import fake_kvpress, tiny_tokenizer
from kvevict.data.ruler import OTHER_TASKS, TASKS, TOKENS_TO_GENERATE, punkt_ready, ruler_samples, string_match_all
from kvevict.eval.runner import run_grid
from kvevict.eval.tasks import TASKS as EVAL_TASKS
from kvevict.eval.tasks import task_names
from kvevict.eval.tasks.base import _generate_cell
from kvevict.generate import generate


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_single_2", "niah_multivalue"])
def test_samples_fit_hold_their_needles_and_repeat(tok, task):
    length = 4096 if TASKS[task]["type_haystack"] == "essay" else 512
    got = ruler_samples(task, tok, length, 3)
    assert len(got) == 3 and got == ruler_samples(task, tok, length, 3)  # seeded
    assert got != ruler_samples(task, tok, length, 3, seed=7)
    for s in got:
        assert len(tok(s["input"] + " " + " ".join(s["outputs"])).input_ids) + TOKENS_TO_GENERATE <= length
        for answer in s["outputs"]:
            assert f"is: {answer}." in s["input"]  # "One of the special magic numbers for KEY is: VALUE."
        assert s["gen_prefix"].startswith("The special magic")
    assert len(got[0]["outputs"]) == TASKS[task].get("num_needle_v", 1) * TASKS[task].get("num_needle_q", 1)


@pytest.mark.parametrize("task", ["vt", "cwe", "fwe"])
def test_aggregation_tasks_are_lm_evals_seeded_and_their_answers_hold(real_model, task):
    """Variable tracking, common and frequent words: seeded (the first samples of a larger n are
    the same), within the length, and each answer is what the text says it is (SmolLM2's
    tokenizer: vt's few-shot example must fit lm-eval's 500 tokens)."""
    import re
    from collections import Counter

    _, tok = real_model
    length = 2048
    got = ruler_samples(task, tok, length, 3)
    assert got[:2] == ruler_samples(task, tok, length, 2) and got != ruler_samples(task, tok, length, 3, seed=7)
    for s in got:
        assert len(tok(s["input"]).input_ids) + OTHER_TASKS[task] <= length
        text, answers = s["input"], s["outputs"]
        if task == "vt":  # a chain VAR A = value, VAR B = VAR A, ...: the five names holding the asked value
            value = re.search(r"assgined the value (\d+)", s["gen_prefix"]).group(1)
            assert f"VAR {answers[0]} = {value}" in text and len(answers) == 5
            assert all(f"VAR {b} = VAR {a}" in text for a, b in zip(answers, answers[1:]))
        elif task == "cwe":  # the 10 words repeated most in the numbered list
            words = Counter(re.findall(r"\d+\. (\S+)", text.split("\n", 1)[1]))
            assert set(answers) == {w for w, _ in words.most_common(10)} and len(answers) == 10
            assert min(words[a] for a in answers) > max(c for w, c in words.items() if w not in answers)
        else:  # the three most frequent coded words ("..." is noise)
            words = Counter(w for w in text.split() if len(w) == 6 and w.isalpha() and w.islower())
            assert [w for w, _ in words.most_common(3)] == answers
    named = EVAL_TASKS[f"ruler-{task}"](lengths=(length,))
    sample = named.samples(tok, 1)[0]
    assert named.max_new(sample, tok) == OTHER_TASKS[task]
    assert sample.data["messages"].endswith(got[0]["gen_prefix"]) and sample.data["answers"] == got[0]["outputs"]


@pytest.mark.parametrize("task", ["vt", "cwe"])
def test_a_length_lm_evals_generator_cannot_fill_is_refused_not_looped_on(tok, task):
    """lm-eval's vt and cwe retry their smallest sample forever when it does not fit."""
    with pytest.raises(ValueError, match="ruler-" + task):
        ruler_samples(task, tok, 300, 1)


def test_essay_haystack_is_the_shipped_essays_split_offline(tok):
    import nltk

    from kvevict.data.essays import essays

    punkt_ready()
    assert len(nltk.sent_tokenize("It rained. The fair went on.")) == 2  # no download was needed
    s = ruler_samples("niah_single_2", tok, 4096, 1)[0]
    first_words = " ".join(" ".join(essays()).split()[:12])
    assert first_words in s["input"]


def test_string_match_all_is_the_share_of_answers_found():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_all("UUID ABC-def", ["abc-DEF"]) == 1.0
    assert string_match_all("nothing", ["1"]) == 0.0


def test_ruler_tasks_are_named_and_not_in_all():
    assert "ruler-niah_single_1" in EVAL_TASKS and task_names("ruler-niah_multikey_1") == ["ruler-niah_multikey_1"]
    assert task_names("ruler-vt,ruler-cwe,ruler-fwe") == ["ruler-vt", "ruler-cwe", "ruler-fwe"]
    assert not any(t.startswith("ruler-") for t in task_names("all"))


def test_memory_cells_equal_generate_with_memory_and_kvzip_is_recorded_once(tok, monkeypatch):
    from kvevict.policies.kvzip import KVzip

    model = tiny_model("llama-gqa")
    prompt = ruler_samples("niah_single_1", tok, 512, 1)[0]
    prompt = prompt["input"] + " " + prompt["gen_prefix"]
    calls = []
    original = KVzip.record.__func__
    monkeypatch.setattr(KVzip, "record", classmethod(lambda cls, *a, **k: calls.append(1) or original(cls, *a, **k)))
    recorded = {}
    for share in (0.1, 0.05):  # kvzip-pool's shares (below kvevict.default_policy.SAMPLE_FROM)
        got = _generate_cell(model, tok, prompt, "mem", share, 8, recorded)
        want = generate(model, tok, prompt, None, 0.2, 8, memory=share)  # records again: its own pass
        assert (got.text, got.kv_bytes, got.full_kv_bytes) == (want.text, want.kv_bytes, want.full_kv_bytes)
        assert got.policy == "kvzip-pool" and got.seconds >= recorded["kvzip-pool"][1]
    assert len(calls) == 2 + 1  # the cells shared one recording; each generate() made its own
    named = _generate_cell(model, tok, prompt, "mem-h2o", 0.2, 8, {})
    want = generate(model, tok, prompt, "h2o", 0.2, 8, memory=0.2)
    assert (named.text, named.kv_bytes) == (want.text, want.kv_bytes)
    assert named.kv_bytes < named.full_kv_bytes


def test_grid_runs_a_ruler_task_with_memory_cells(tmp_path, tok):
    class Tiny(EVAL_TASKS["ruler-niah_single_1"]):
        max_new_tokens = 4

    model = tiny_model("llama-gqa")
    run_grid(model, tok, [Tiny(lengths=(512,))], ["mem", "mem-h2o"], [0.2], 2, tmp_path, "tiny", log=lambda m: None)
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted((r["policy"], r["sample"]) for r in recs) == sorted(
        (p, s) for p in ("full", "mem", "mem-h2o") for s in ("512-0", "512-1")
    )
    for r in recs:
        assert 0.0 <= r["scores"]["score"] <= 1.0 and r["task"] == "ruler-niah_single_1"
        if r["policy"] != "full":
            assert r["kv_bytes"] < r["full_kv_bytes"]


def test_punkt_is_trained_into_a_fresh_cache(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path))
    monkeypatch.setattr(nltk.data, "path", list(nltk.data.path))
    root = punkt_ready.__wrapped__()  # not the memoized call: this cache is new
    assert root == str(tmp_path / "nltk_data") and nltk.data.path[0] == root
    assert (tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english" / "sent_starters.txt").exists()


def test_the_kvpress_peer_with_the_question_apart_holds_the_same_tokens(tok, tmp_path, monkeypatch):
    """--peer-question apart: each sample tells kvpress how many tokens its question takes (RULER
    asks on the input's last line, then the answer's start) and the context's compression ratio that
    keeps budget x prompt tokens in all, question whole; the records are kvpress-<press>/context."""
    from kvevict.eval import peer_kvpress, records
    from kvevict.eval.tasks import TASKS as ALL

    jobs = fake_kvpress(tok, tmp_path, monkeypatch)
    task = ALL["ruler-niah_single_1"](lengths=(512,))
    samples = task.samples(tok, 2)
    out = tmp_path / "out"
    assert peer_kvpress.run_peer("m", tok, [task], ["snapkv"], [0.6], 2, out, question="apart", log=lambda m: None) == 2
    for s, js in zip(samples, jobs[0]["samples"]):
        n, q = len(js["ids"]), js["question"]
        assert s.data["question"].startswith("What is the special magic number")
        assert s.data["messages"].endswith("\n" + s.data["question"])
        assert tok.decode(js["ids"][n - q :]).strip() == s.data["question"]  # the question, all of it
        assert (1 - js["compression_ratio"]) * (n - q) + q == pytest.approx(0.6 * n)
    assert {k[2] for k in records.load(out)} == {"kvpress-snapkv/context"}
    with pytest.raises(ValueError, match="choose pressed or apart"):
        peer_kvpress.run_peer("m", tok, [task], ["snapkv"], [0.6], 2, tmp_path / "o3", question="after")
    with pytest.raises(ValueError, match="no more than its question"):
        peer_kvpress.run_peer("m", tok, [task], ["snapkv"], [0.01], 2, tmp_path / "o2", question="apart")
    # the same refusal, checked before any cell runs (kvevict eval calls it ahead of its own grid)
    peer_kvpress.check_question_fits(tok, [task], [0.6, 16], 2)
    with pytest.raises(ValueError, match="no more than its question"):
        peer_kvpress.check_question_fits(tok, [task], [0.6, 0.01], 2, first=1)


def test_eval_refuses_a_budget_below_the_question_before_its_own_grid_runs(tok, tmp_path, monkeypatch, capsys):
    """`kvevict eval --peer kvpress --peer-question apart`: kvevict's cells run first and may take hours,
    so a budget kvpress's protocol cannot hold is refused before them."""
    from conftest import tiny_model
    from kvevict.cli import main
    from kvevict.commands import eval as eval_command
    from kvevict.eval import runner

    monkeypatch.setattr(eval_command, "load_model_args", lambda args: (tiny_model("llama-gqa"), tok))
    monkeypatch.setattr("kvevict.peers.locations.find", lambda name: None)
    ran = []
    monkeypatch.setattr(runner, "run_grid", lambda *a, **k: ran.append(a))
    argv = ["eval", "--tasks", "ruler-niah_single_1", "--lengths", "512", "--samples", "1", "--policies", "h2o"]
    argv += ["--peer", "kvpress", "--peer-question", "apart", "--out", str(tmp_path), "--threads", "1"]
    assert main(argv + ["--budgets", "0.01"]) == 2
    assert "no more than its question" in capsys.readouterr().err and not ran
