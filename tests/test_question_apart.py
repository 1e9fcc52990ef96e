"""The question-apart protocol (``kvevict eval --question apart``, ``kvevict.eval.apart``): the
context compressed alone, the question's tokens all kept after it, each record and table labelled."""

import json

import pytest
import torch

import kvevict
from conftest import tiny_model
from eval_helpers import FIXTURES, essay_like, tiny_tokenizer
from kvevict.cli import main
from kvevict.data.narrativeqa import narrativeqa
from kvevict.data.xsum import xsum
from kvevict.eval.apart import answer_apart, context_budget, question_length
from kvevict.eval.report import summarize
from kvevict.eval.runner import run_grid
from kvevict.eval.tasks import NarrativeQATask, RetrievalTask, XSumTask


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_the_questions_tokens_are_all_in_the_cache_after_the_compressed_context():
    model = tiny_model("llama-gqa")
    gen = torch.Generator().manual_seed(0)
    context, question = torch.randint(4, 128, (1, 200), generator=gen), torch.randint(4, 128, (1, 17), generator=gen)
    ctx = kvevict.compress(model, None, context, "snapkv@0.2")
    kept = [sum(t.filled for t in layer._parts()) for layer in ctx.cache.layers]
    assert max(kept) <= 40  # the context alone was compressed to its budget
    fork = ctx.fork()
    with torch.no_grad():
        model(question, cache=fork)
    assert fork.get_seq_length() == 200 + 17
    for layer, before in zip(fork.layers, kept):
        # every question token kept whole, at the positions that follow the whole context
        assert layer.tail.filled == 17 and bool(layer.tail.valid[:, :17].all())
        assert layer.tail.pos[0, :17].tolist() == list(range(200, 217))
        assert sum(t.filled for t in layer.parent._parts()) == before  # the context's slots as they were
        assert layer.view.n + layer.tail.filled == before + 17  # what the next token attends to
    # the question's keys are the model's own for those tokens after that context: one more token
    # fed to the fork attends over exactly the compressed context and the question
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=fork)
    assert fork.layers[0].tail.filled == 18


def test_a_cell_holds_what_it_holds_with_the_question_inside():
    # 20% of a 200-token prompt is 40 tokens: with 10 of them the question's, 30 of the 190 context tokens
    assert context_budget(0.2, 200, 10) == pytest.approx(30 / 190, abs=1e-6)
    assert context_budget(64, 200, 10) == 54
    with pytest.raises(ValueError, match="no more than its question"):
        context_budget(0.05, 200, 10)
    with pytest.raises(ValueError, match="no more than the question"):
        context_budget(10, 200, 10)


def test_an_apart_cell_is_compress_then_answer(tok):
    """The runner's apart cell cuts the prompt where its question starts (the tokens kvpress's
    ``--peer-question apart`` cuts) and answers as compress + answer by hand."""
    model = tiny_model("llama-gqa")
    task = RetrievalTask(lengths=(160,), depths=(0.5,), kinds=("single",), haystack_fn=essay_like)
    sample = task.samples(tok, 1)[0]
    prompt = sample.data["messages"]
    ids = kvevict.generate.encode_chat(tok, prompt)
    q = question_length(tok, sample)
    assert "What is the pass key?" in tok.decode(ids[0, -q:]) and "What is" not in tok.decode(ids[0, :-q])
    got = answer_apart(model, tok, prompt, sample, ("h2o", 0.5), 8, {})
    share = (0.5 * ids.shape[1] - q) / (ids.shape[1] - q)
    ctx = kvevict.compress(model, tok, ids[:, :-q], "h2o", budget=round(share, 6))
    assert got.text == ctx.answer(ids[:, -q:], 8).text
    assert got.policy == "h2o" and got.prompt_tokens == ids.shape[1]


def test_the_grid_runs_the_question_apart_and_labels_it(tmp_path, tok):
    model = tiny_model("llama-gqa")
    tasks = [
        RetrievalTask(lengths=(160,), depths=(0.5,), haystack_fn=essay_like),
        NarrativeQATask(items=narrativeqa(FIXTURES / "narrativeqa-tiny.jsonl")),
        XSumTask(items=xsum(FIXTURES / "xsum-tiny.jsonl")),  # its instruction comes first: inside
    ]
    logs: list = []
    n = run_grid(model, tok, tasks, ["h2o", "mem"], [0.5], 2, tmp_path, "tiny", log=logs.append, question="apart")
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert n == len(recs)
    cells = {(r["task"], r["policy"], r["question"]) for r in recs}
    for task in ("passkey", "narrativeqa"):
        assert {(p, q) for t, p, q in cells if t == task} == {
            ("full", "inside"),
            ("h2o/context", "apart"),
            ("mem/context", "apart"),
        }
    assert {(p, q) for t, p, q in cells if t == "xsum"} == {("full", "inside"), ("h2o", "inside"), ("mem", "inside")}
    assert any("xsum: no question ends its prompt" in m for m in logs)
    # the same folder takes the inside cells beside the apart ones, the reference shared
    run_grid(model, tok, tasks[:1], ["h2o"], [0.5], 2, tmp_path, "tiny", log=logs.append)
    md = summarize(tmp_path, "tiny")
    section = md[md.index("## passkey") : md.index("## narrativeqa")]
    assert "| h2o/context |" in section and "| h2o |" in section
    tables = section.count("| em |") + section.count("Paired difference")
    assert section.count("Question: inside the compressed prompt, but apart in `/context` rows") == tables
    qa = md[md.index("## narrativeqa") : md.index("## xsum")]
    assert qa.count("Question: apart in every row but full") == qa.count("| f1 |") + qa.count("Paired difference")
    assert "Question: inside the compressed prompt in every row." in md[md.index("## xsum") :]


def test_eval_takes_question_inside_or_apart_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--question", "sideways", "--summary-only"])
    assert exit_.value.code == 2
    assert "--question: invalid choice: 'sideways' (choose from 'inside', 'apart')" in capsys.readouterr().err
