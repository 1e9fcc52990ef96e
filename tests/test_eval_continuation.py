"""The continuation task on a tiny random model: the context prefilled under each cell (kvzip
recorded first), the continuation scored teacher-forced against the full cache."""

import math

import pytest
import torch

from conftest import tiny_model
from eval_helpers import essay_like, tiny_tokenizer
from kvevict.eval import bytes_report, records
from kvevict.eval.runner import run_grid
from kvevict.eval.tasks import TASKS, ContinuationTask


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa")


def _task(tok, **kw):
    texts = {"fixture": [essay_like(tok, 300), essay_like(tok, 300).replace("green", "grey")]}
    return ContinuationTask(
        **{"context": 48, "continuation": 20, "chunk": 8, "sources": ("fixture",), "texts": texts, **kw}
    )


def test_full_cell_equals_one_forward_pass_over_the_continuation(tok, model):
    task = _task(tok)
    sample = task.samples(tok, 1)[0]
    ids = torch.tensor([sample.data["ids"]])
    assert ids.shape[1] == 68
    with torch.no_grad():
        logits = model(ids).logits[0]
    want = torch.nn.functional.cross_entropy(logits[47:67], ids[0, 48:68], reduction="none")
    full = task.evaluate(model, tok, sample, [("full", None)], None)[("full", None)]
    assert full["scores"]["nll"] == pytest.approx(want.mean().item(), abs=1e-4)
    assert full["scores"]["nll_late"] == pytest.approx(want[10:].mean().item(), abs=1e-4)
    assert full["scores"]["top1"] == 1.0 and full["scores"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert full["kv_bytes"] == 2 * full["full_kv_bytes"] > 0  # the fp32 stock cache, against 16 bits


def test_covering_budget_equals_full_and_small_budgets_differ(tok, model):
    task = _task(tok)
    sample = task.samples(tok, 1)[0]
    # 68 tokens hold context and continuation; 1.0 is the context's 48, so it evicts while the
    # continuation comes in, as generation does
    cells = [("h2o", 68), ("h2o", 0.2), ("kvzip-pool", 0.2), ("h2o", 1.0)]  # no full cell: still the reference
    res = task.evaluate(model, tok, sample, cells, None)
    assert set(res) == set(cells)
    full = task.evaluate(model, tok, sample, [("full", None)], None)[("full", None)]["scores"]
    cover = res[("h2o", 68)]["scores"]
    assert cover["nll"] == pytest.approx(full["nll"], abs=1e-4) and cover["top1"] == 1.0
    fp32_stock = 2 * res[("h2o", 1.0)]["full_kv_bytes"]  # the model's own dtype: twice the 16-bit denominator
    assert res[("h2o", 0.2)]["kv_bytes"] < res[("h2o", 1.0)]["kv_bytes"] < fp32_stock
    for cell in cells[1:3]:
        sc, rec = res[cell]["scores"], res[cell]
        assert math.isfinite(sc["nll"]) and abs(sc["nll"] - full["nll"]) > 1e-4
        assert sc["kl"] > 1e-5
        # a fraction of the 48-token context: far fewer bytes than the fp32 full cache of 67 tokens
        assert 0 < rec["kv_bytes"] < 0.5 * 2 * rec["full_kv_bytes"]


def test_a_memory_cell_scores_the_known_context_as_generate_would(tok, model):
    # a context longer than the short-prompt floor (128 tokens), so the memory budget evicts
    texts = {"fixture": [essay_like(tok, 900)]}
    task = ContinuationTask(context=400, continuation=20, chunk=8, sources=("fixture",), texts=texts)
    sample = task.samples(tok, 1)[0]
    cells = [("mem", 0.2), ("mem-kvzip-sample", 0.2), ("mem-h2o", 0.2), ("mem-kvzip-pool", 0.2)]
    cells += [("mem-kvzip-pool/int4", 0.2)]
    res = {c: r["scores"]["nll"] for c, r in task.evaluate(model, tok, sample, cells, None).items()}
    # the context is known: prompt-scoring (no probe for this model: KVzip over a sample of it)
    assert res[("mem", 0.2)] == res[("mem-kvzip-sample", 0.2)]
    assert res[("mem", 0.2)] != res[("mem-h2o", 0.2)]
    assert res[("mem-kvzip-pool/int4", 0.2)] != res[("mem-kvzip-pool", 0.2)]  # the same bytes spent at int4


def test_sample_ids_are_stable_and_name_the_split(tok):
    a = [s.id for s in _task(tok).samples(tok, 2)]
    assert a == [s.id for s in _task(tok).samples(tok, 2)]
    assert a == ["fixture-0-48+20", "fixture-1-48+20"]
    assert [s.id for s in _task(tok, context=40, continuation=28).samples(tok, 2)] != a
    assert TASKS["continuation"] is ContinuationTask


def test_bad_lengths_are_a_value_error():
    with pytest.raises(ValueError, match="context, continuation and chunk"):
        ContinuationTask(context=0)


def test_grid_records_feed_the_bytes_report(tmp_path, tok, model):
    run_grid(model, tok, [_task(tok)], ["h2o", "kvzip-pool"], [0.25], 2, tmp_path, "tiny", log=lambda m: None)
    recs = list(records.load(tmp_path).values())
    assert len(recs) == 6
    rows = bytes_report.rows(recs)
    assert {(r["task"], r["policy"], r["n"]) for r in rows} == {
        ("continuation", "h2o", 2),
        ("continuation", "kvzip-pool", 2),
    }
    assert all(0 < r["bytes"] < 1 for r in rows)
