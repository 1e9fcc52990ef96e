"""The grid end to end on a tiny random model with a tiny tokenizer: streaming scores, every task,
records, resume, summary and plots."""

import json

import pytest
import torch

from conftest import tiny_model
from eval_helpers import FIXTURES, essay_like, fake_kvpress, tiny_tokenizer
from kvevict.data.narrativeqa import narrativeqa
from kvevict.data.piqa import piqa
from kvevict.data.xsum import xsum
from kvevict.eval import records
from kvevict.eval.metrics import rouge
from kvevict.eval.report import summarize
from kvevict.eval.runner import run_grid
from kvevict.eval.streaming import continuation_logprob, stream_compare
from kvevict.eval.tasks import NarrativeQATask, PerplexityTask, PIQATask, ReconstructionTask, RetrievalTask, XSumTask


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_streaming_with_a_budget_holding_everything_equals_the_full_cache():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    sc = stream_compare(model, ids, [("full", None), ("h2o", 64), ("h2o", 12)], chunk=8)
    assert len(sc[("full", None)].nll) == 59
    assert sc[("h2o", 64)].nll == pytest.approx(sc[("full", None)].nll, abs=1e-4)
    assert sum(sc[("h2o", 64)].top1) == 59 and max(sc[("h2o", 64)].kl) < 1e-6
    # a 12-token budget really evicts while streaming: later predictions move away from the full cache
    assert max(sc[("h2o", 12)].kl[20:]) > 1e-4
    assert sc[("h2o", 12)].nll[:11] == pytest.approx(sc[("full", None)].nll[:11], abs=1e-4)


def test_a_memory_cell_streams_under_the_plan_a_streamed_text_gets():
    """``mem`` in a streaming task: ``make_cache(memory=share)`` with the streaming policy, the share
    fixed against the whole text, so the bytes held are that share of a 16-bit stock cache."""
    from kvevict import make_cache

    model = tiny_model("llama-gqa")
    # 400 tokens: half of them is past the floor a short prompt keeps (kvevict.memory.MIN_TOKENS);
    # 30% of a 16-bit cache is below int4 for every token here (head_dim 16: 26/64), so it evicts
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    sc = stream_compare(model, ids, [("full", None), ("mem", 0.3), ("mem-tova", 0.3)], chunk=16)
    dims, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    for cell in (("mem", 0.3), ("mem-tova", 0.3)):
        # within the budget up to a slot of rounding per layer and KV head (as tests/test_quantized.py)
        assert sc[cell].kv_bytes <= 0.3 * sc[cell].full_kv_bytes + 2 * dims * layers * (16 * 2 * 4)
        assert max(sc[cell].kl[200:]) > 1e-4  # it evicted or quantized: not the full cache
    # the same as streaming by hand through make_cache(memory=0.5) fixed against the 400 tokens
    cache = make_cache(model, memory=0.3)
    cache.set_prompt_length(400)
    with torch.no_grad():
        want = [model(ids[:, s : min(399, s + 16)], cache=cache).logits[0] for s in range(0, 399, 16)]
    want = torch.cat(want).log_softmax(-1).gather(1, ids[0, 1:, None]).neg().squeeze(1)
    assert sc[("mem", 0.3)].nll == pytest.approx(want.tolist(), abs=1e-4)
    assert sc[("mem", 0.3)].kv_bytes == cache.kv_bytes()


def test_continuation_logprob_full_matches_one_forward_pass():
    model = tiny_model("llama-gqa")
    ctx, cont = torch.tensor([[5, 9, 17, 3]]), torch.tensor([[40, 41, 42]])
    with torch.no_grad():
        logits = model(torch.cat([ctx, cont], 1)).logits[0].log_softmax(-1)
    want = sum(logits[3 + i, cont[0, i]].item() for i in range(3))
    assert continuation_logprob(model, ctx, cont, "full", None) == pytest.approx(want, abs=1e-4)
    assert continuation_logprob(model, ctx, cont, "h2o", 100) == pytest.approx(want, abs=1e-4)
    assert continuation_logprob(model, ctx, cont, "oracle", 100) == pytest.approx(want, abs=1e-4)


def test_streaming_records_the_oracle_on_the_streamed_text():
    from kvevict import make_cache
    from kvevict.policies.oracle import Oracle

    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    sc = stream_compare(model, ids, [("full", None), ("oracle", 64), ("oracle", 12)], chunk=8)
    assert sc[("oracle", 64)].nll == pytest.approx(sc[("full", None)].nll, abs=1e-4)
    # the same as streaming by hand through a cache whose oracle was recorded on these ids
    cache = make_cache(model, Oracle.record(model, ids), 12)
    with torch.no_grad():
        want = [model(ids[:, s : min(59, s + 8)], cache=cache).logits[0] for s in range(0, 59, 8)]
    want = torch.cat(want).log_softmax(-1).gather(1, ids[0, 1:, None]).neg().squeeze(1)
    assert sc[("oracle", 12)].nll == pytest.approx(want.tolist(), abs=1e-4)
    assert max(sc[("oracle", 12)].kl[20:]) > 1e-4  # it did evict


def _tasks(tok):
    texts = {"fixture": [essay_like(tok, 300), essay_like(tok, 300).replace("green", "grey")]}
    return [
        PerplexityTask(tokens=64, chunk=16, sources=("fixture",), texts=texts),
        RetrievalTask(lengths=(96,), depths=(0.5,), haystack_fn=essay_like),
        XSumTask(items=xsum(FIXTURES / "xsum-tiny.jsonl")),
        ReconstructionTask(tokens=8, items=xsum(FIXTURES / "xsum-tiny.jsonl")),
        NarrativeQATask(items=narrativeqa(FIXTURES / "narrativeqa-tiny.jsonl")),
        PIQATask(items=piqa(FIXTURES / "piqa-tiny.jsonl")),
    ]


def test_grid_end_to_end_resume_and_report(tmp_path, tok):
    model = tiny_model("llama-gqa")
    logs = []
    n = run_grid(model, tok, _tasks(tok), ["h2o"], [0.2, 0.5], 2, tmp_path, "tiny", log=logs.append)
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert n == len(recs)
    by_task = {}
    for r in recs:
        by_task.setdefault(r["task"], set()).add((r["policy"], r["budget"], r["sample"]))
    # every task: 2 samples (NarrativeQA has one story in the fixture) x (full + 2 budgets)
    assert {t: len(v) for t, v in by_task.items()} == {
        "ppl": 6,
        "passkey": 6,
        "xsum": 6,
        "reconstruct": 6,
        "narrativeqa": 3,
        "piqa": 6,
    }
    assert any("only 1 samples available" in m for m in logs)
    # the full cache's streamed NLL is the NLL of one plain forward pass over the window
    full_ppl = {r["sample"]: r for r in recs if r["task"] == "ppl" and r["policy"] == "full"}
    samples = _tasks(tok)[0].samples(tok, 2)
    assert sorted(full_ppl) == sorted(s.id for s in samples)
    for s in samples:
        ids = torch.tensor([s.data["ids"]])
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item()
        assert full_ppl[s.id]["scores"]["nll"] == pytest.approx(want, abs=1e-4)
    # a budgeted summary's rougeL_vs_full is scored against the full cache's summary of its sample
    full_xsum = {r["sample"]: r["output"] for r in recs if r["task"] == "xsum" and r["policy"] == "full"}
    budgeted = [r for r in recs if r["task"] == "xsum" and r["policy"] == "h2o"]
    assert len(budgeted) == 4 and set(full_xsum) == {r["sample"] for r in budgeted}
    for r in budgeted:
        want = rouge(r["output"], full_xsum[r["sample"]])["rougeL"]
        assert r["scores"]["rougeL_vs_full"] == pytest.approx(want)
    for r in recs:
        if r["task"] == "ppl" and r["policy"] == "h2o":
            assert r["budget_tokens"] == (13 if r["budget"] == 0.2 else 32)

    # resume: nothing left to do
    assert run_grid(model, tok, _tasks(tok), ["h2o"], [0.2, 0.5], 2, tmp_path, "tiny", log=logs.append) == 0
    # drop one record (and tear the last line as a killed run would): exactly that one is redone
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    dropped = json.loads(lines[3])
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:3] + lines[4:]) + '\n{"model": "ti')
    assert run_grid(model, tok, _tasks(tok), ["h2o"], [0.2, 0.5], 2, tmp_path, "tiny", log=logs.append) == 1
    assert records.record_key(dropped) in records.load(tmp_path)
    assert len(records.load(tmp_path)) == len(recs)

    md = summarize(tmp_path, "tiny")
    assert (tmp_path / "summary.md").read_text() == md
    for task in by_task:
        assert f"## {task}" in md
        for png in (tmp_path / f"{task}.png", tmp_path / f"{task}-paired.png"):
            assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert "ppl = exp(nll)" in md and "Paired difference" in md


def test_a_grid_split_by_first_sample_merges_into_the_whole_grid(tmp_path, tok):
    model = tiny_model("llama-gqa")
    tasks = _tasks(tok)[:2]  # ppl and passkey: 2 samples each
    args = (["h2o"], [0.2], 2)
    run_grid(model, tok, tasks, *args, tmp_path / "whole", "tiny", log=lambda m: None)
    assert run_grid(model, tok, tasks, *args, tmp_path / "tail", "tiny", log=lambda m: None, first=1) == 4
    run_grid(model, tok, tasks, ["h2o"], [0.2], 1, tmp_path / "head", "tiny", log=lambda m: None)

    def scores(folder):
        return {k: r["scores"] for k, r in records.load(folder).items()}

    whole, head, tail = scores(tmp_path / "whole"), scores(tmp_path / "head"), scores(tmp_path / "tail")
    assert not head.keys() & tail.keys()  # the tail ran only the second sample of each task
    assert len(whole) == 8
    merged = {**head, **tail}
    assert merged.keys() == whole.keys()
    for k in whole:
        assert merged[k] == pytest.approx(whole[k]), k


def test_paired_to_full_pairs_samples_and_skips_unpaired_ones():
    from kvevict.eval.report import paired_to_full

    cells = {
        ("full", None): {"a": 3.0, "b": 5.0, "c": 4.0},
        ("h2o", 0.2): {"a": 4.0, "b": 5.5, "z": 9.0},  # z has no full-cache record: not paired
        ("roco", 0.2): {"c": 3.0},
    }
    d = paired_to_full(cells)
    assert set(d) == {("h2o", 0.2), ("roco", 0.2)}
    assert (d[("h2o", 0.2)].n, d[("h2o", 0.2)].mean) == (2, 0.75)
    # diffs 1.0 and 0.5: sd = 0.3536, half width = t(1) * sd / sqrt(2) = 12.706 * 0.25
    assert d[("h2o", 0.2)].hi - d[("h2o", 0.2)].mean == pytest.approx(12.706 * 0.25)
    assert (d[("roco", 0.2)].n, d[("roco", 0.2)].mean) == (1, -1.0)


class _FlakyTask:
    """A task without a model: cell ('h2o', 0.5) cannot run; the others score 1."""

    name, on_cell = "flaky", None
    metrics, primary = {"em": "proportion"}, "em"

    def samples(self, tokenizer, n):
        from kvevict.eval.tasks import Sample

        return [Sample(id=f"s{i}", data={}) for i in range(n)]

    def evaluate(self, model, tokenizer, sample, cells, reference):
        if ("h2o", 0.5) in cells:
            raise ValueError("budget too small for this policy")
        return {c: {"scores": {"em": 1.0}} for c in cells}


def test_a_cell_that_cannot_run_is_skipped_and_the_others_written(tmp_path):
    logs = []
    n = run_grid(None, None, [_FlakyTask()], ["h2o"], [0.2, 0.5], 2, tmp_path, "m", log=logs.append)
    assert n == 4  # (full, 0.2) x 2 samples
    assert sum("skipped ('h2o', 0.5)" in m for m in logs) == 2
    assert {k[3] for k in records.load(tmp_path)} == {"full", "0.2"}


def test_real_model_streaming_perplexity_is_sane(real_model):
    """SmolLM2 on a short real paragraph: a sane full-cache perplexity, and a budget that holds
    the whole text reproduces it exactly."""
    model, tok = real_model
    text = (FIXTURES / "xsum-tiny.jsonl").read_text()
    texts = {"fixture": [" ".join(json.loads(line)["document"] for line in text.splitlines()) * 2]}
    task = PerplexityTask(tokens=96, chunk=32, sources=("fixture",), texts=texts)
    (sample,) = task.samples(tok, 1)
    res = task.evaluate(model, tok, sample, [("full", None), ("h2o", 1.0), ("h2o", 0.25)], None)
    full = res[("full", None)]["scores"]
    assert 1.0 < torch.tensor(full["nll"]).exp() < 60  # repeated text: low perplexity
    assert res[("h2o", 1.0)]["scores"]["nll"] == pytest.approx(full["nll"], abs=1e-3)
    assert res[("h2o", 0.25)]["scores"]["top1"] < 1.0


def test_plot_draws_storage_cells_without_a_budget_as_levels(tmp_path):
    """ "full/int4" keeps every token (budget None): drawn as a level beside the budgeted policies."""
    from kvevict.eval.report import plot_task

    cells = {
        ("full", None): {"a": 1.0, "b": 0.0},
        ("full/int4", None): {"a": 1.0, "b": 1.0},
        ("h2o", 0.2): {"a": 0.0, "b": 0.0},
        ("h2o", 0.1): {"a": 0.0, "b": 1.0},
    }
    path = tmp_path / "passkey.png"
    plot_task("passkey", {"em": cells}, {"em": "accuracy"}, path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_kvpress_peer_runs_in_the_dtype_of_kvevicts_cells(tok, tmp_path, monkeypatch):
    """kvpress's process gets the evaluation's dtype (a bf16 grid is compared with bf16 presses) and
    compression_ratio = 1 - budget; its answers become records of policy kvpress-<press>."""
    from kvevict.eval import peer_kvpress, records
    from kvevict.eval.tasks.retrieval import RetrievalTask

    jobs = fake_kvpress(tok, tmp_path, monkeypatch)
    task = RetrievalTask(lengths=(96,), depths=(0.5,), haystack_fn=essay_like)
    out = tmp_path / "out"
    n = peer_kvpress.run_peer("m", tok, [task], ["snapkv"], [0.25], 2, out, dtype="bfloat16", log=lambda m: None)
    assert n == 2
    assert [(j["dtype"], j["compression_ratio"], j["press"]) for j in jobs] == [("bfloat16", 0.75, "snapkv")]
    got = records.load(out)
    assert {r["policy"] for r in got.values()} == {"kvpress-snapkv"} and len(got) == 2


def test_kvpress_records_of_the_harness_that_refilled_the_cache_are_run_again(tok, tmp_path, monkeypatch):
    """A kvpress record without the decode mark came from the harness whose model.generate refilled
    the pressed cache with the prompt: loading drops it (the report never shows it) and the peer
    runs that sample again; kvevict's own records are untouched."""
    import json

    from kvevict.eval import peer_kvpress, records
    from kvevict.eval.tasks.retrieval import RetrievalTask

    jobs = fake_kvpress(tok, tmp_path, monkeypatch)
    task = RetrievalTask(lengths=(96,), depths=(0.5,), haystack_fn=essay_like)
    ids = [s.id for s in task.samples(tok, 2)]
    out = tmp_path / "out"
    out.mkdir()
    old = [
        {"model": "m", "task": task.name, "policy": p, "budget": b, "sample": i, "scores": {"em": 1.0}}
        for i in ids
        for p, b in (("kvpress-snapkv", 0.25), ("h2o", 0.25))
    ]
    old[2]["decode"] = records.PEER_DECODE  # the second sample's kvpress record: already re-run
    (out / records.FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    assert sorted((k[2], k[4]) for k in records.load(out)) == sorted(
        [("h2o", ids[0]), ("h2o", ids[1]), ("kvpress-snapkv", ids[1])]
    )
    assert not records.stale({**old[0], "policy": "kvpress-kvzip"})  # a masking press held the whole prompt anyway
    assert peer_kvpress.run_peer("m", tok, [task], ["snapkv"], [0.25], 2, out, log=lambda m: None) == 1
    assert [s["id"] for s in jobs[0]["samples"]] == [ids[0]]
    got = records.load(out)
    assert len(got) == 4 and all(r.get("decode") == records.PEER_DECODE for r in got.values() if r["policy"] != "h2o")
