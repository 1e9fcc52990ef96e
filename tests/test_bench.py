"""benchmarks/bench.py: the arithmetic against hand-computed values, the caches it decodes from, its
timers, its target verdicts, and one --quick run on a tiny model for the shape of its outputs
(never for speed: speed lives in the bench's own output)."""

import json
import math

import pytest
import torch
from benchmarks.bench import main
from benchmarks.cachebench import memory_math as mm
from benchmarks.cachebench import targets, timers
from benchmarks.cachebench.caches import (
    NO_EVICTION,
    STOCK,
    CacheSpec,
    expand,
    prefill,
    state_bytes,
)
from benchmarks.cachebench.stats import summary

from conftest import DEADLINE, tiny_model

GiB = 2**30


def test_kv_bytes_per_token_smollm2():
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) dims x 4 bytes (fp32) = 46,080 B
    assert mm.kv_bytes_per_token(30, 3, 64, 4) == 46080
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    assert mm.model_kv_bytes_per_token(cfg) == 46080


def test_bandwidth_and_floor_by_hand():
    # copying 1 GB in 0.1 s reads 1 GB and writes 1 GB: 20 GB/s
    assert mm.copy_bandwidth(10**9, 0.1) == pytest.approx(2e10)
    # 8 sequences x 1,639 kept tokens x 46,080 B = 604,200,960 B of K/V, + 538,000,000 B of weights,
    # at 22 GB/s: 1,142,200,960 / 22e9 = 51.918 ms
    kv = 8 * CacheSpec("h2o", 0.2).kept_tokens(8192) * mm.kv_bytes_per_token(30, 3, 64, 4)
    assert kv == 604_200_960  # 20% of 8,192 rounds up to 1,639 kept tokens
    assert mm.floor_seconds(538_000_000, kv, 22e9) == pytest.approx(0.0519182, rel=1e-5)
    with pytest.raises(ValueError):
        mm.floor_seconds(1, 1, 0)
    with pytest.raises(ValueError):
        mm.copy_bandwidth(1, 0)


def test_max_batch_by_hand():
    # full 8K cache: 8,192 x 46,080 = 377,487,360 B per sequence; 4 GiB / that = 11.38 -> 11
    assert mm.max_batch(4 * GiB, 8192 * 46080) == 11
    # 20% budget: 1,639 x 46,080 = 75,525,120 B; 4 GiB / that = 56.87 -> 56
    assert mm.max_batch(4 * GiB, 1639 * 46080) == 56
    assert mm.max_batch(100, 101) == 0
    with pytest.raises(ValueError):
        mm.max_batch(100, 0)


def test_matrix_floor_by_hand():
    # SmolLM2 fp32 weights 538,000,000 B; batch 8 of every token at 8,192 in int8: per token and layer and KV head
    # 2 x (64 codes + 2 groups x 4 B of fp16 zero and step) = 144 B; 30 layers x 3 heads -> 12,960 B per token;
    # 8 x 8,192 x 12,960 = 849,346,560 B read; at 20 GB/s: (538,000,000 + 849,346,560) / 2e10 = 69.37 ms
    kv = 8 * 8192 * 30 * 3 * 2 * (64 + 2 * 4)
    assert kv == 849_346_560
    assert mm.floor_seconds(538_000_000, kv, 2e10) == pytest.approx(0.0693673, rel=1e-5)


def test_cache_labels_round_trip():
    for label in ("stock", "kvevict-full/int8", "h2o@0.2", "h2o/int4@0.2", "memory=0.1"):
        assert CacheSpec.parse(label).label == label
    assert CacheSpec.parse("memory=0.2").kept_tokens(8192) == 8192  # the plan keeps every token at 20%
    assert CacheSpec.parse("h2o/int8@0.2").kept_tokens(8192) == 1639
    for bad in ("memory=2", "h2o@x", "memory=", "h2o@0"):
        with pytest.raises(ValueError, match="cannot read the cache"):
            CacheSpec.parse(bad)


def test_peer_comparison_pairs_kvevict_and_llamacpp_ratios():
    from benchmarks.cachebench.matrix import add_step_ratios, peer_comparison

    def rec(cache, steps):
        return {"threads": 2, "context": 3072, "batch": 1, "cache": cache, "round_median_step_s": steps}

    recs = [
        rec("stock", [0.10, 0.10]),
        rec("kvevict-full/fp16", [0.05, 0.06]),
        rec("kvevict-full/int8", [0.05, 0.066]),
        rec("kvevict-full/int4", [0.08, 0.09]),
    ]
    add_step_ratios(recs)
    assert recs[1]["step_vs_stock"]["median"] == pytest.approx(0.55)
    llama = {"ratios": [{"context": 3072, "threads": 2, "kv_type": "q4_0", "step_ratio_vs_f16": {"median": 1.63}}]}
    rows = {r["pair"]: r for r in peer_comparison(recs, llama)}
    assert rows["int8/fp16"]["kvevict"]["median"] == pytest.approx(1.05) and rows["int8/fp16"]["llamacpp"] is None
    assert rows["int4/fp16"]["kvevict"]["median"] == pytest.approx((1.6 + 1.5) / 2)
    assert rows["int4/fp16"]["llamacpp"]["median"] == 1.63


def test_summary_quartiles():
    s = summary([4.0, 1.0, 3.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)
    assert (s["q1"], s["q3"]) == (1.75, 3.25)  # numpy's linear interpolation


@torch.no_grad()
def test_prefilled_caches_are_in_decode_state():
    model = tiny_model()
    ctx, steps = 40, 3
    stock = prefill(model, CacheSpec(STOCK), ctx, steps)
    assert stock.get_seq_length() == ctx
    full = prefill(model, CacheSpec(NO_EVICTION), ctx, steps)
    pol = prefill(model, CacheSpec("h2o", 0.25), ctx, steps)
    assert pol.budget == math.ceil(0.25 * ctx) == CacheSpec("h2o", 0.25).kept_tokens(ctx)
    for spec, base in ((CacheSpec(NO_EVICTION), full), (CacheSpec("h2o", 0.25), pol)):
        from benchmarks.cachebench.caches import use_attention

        use_attention(model, spec)
        c = expand(base, 3)
        for _ in range(steps):
            model(torch.ones(3, 1, dtype=torch.long), cache=c, use_cache=True)
        evicted = c.layers[0].evicted
        # the no-eviction cache never evicts; the budgeted one is full, so every step evicts one token
        assert evicted == (0 if spec.kind == NO_EVICTION else steps)
        assert c.layers[0].keys.shape[0] == 3 and base.layers[0].keys.shape[0] == 1  # the base is untouched
        assert state_bytes(c) >= c.kv_bytes() > 0


def test_exclusive_timers_subtract_nested_calls(monkeypatch):
    clock = iter(range(100))

    class FakeTime:
        @staticmethod
        def perf_counter():
            return float(next(clock))

    monkeypatch.setattr(timers, "time", FakeTime)

    class Work:
        def outer(self):
            return self.inner() + 1

        def inner(self):
            return 1

    original = Work.__dict__["outer"]
    with timers.ExclusiveTimers() as t:
        assert t.wrap(Work, "outer", "a") and t.wrap(Work, "inner", "b")
        assert not t.wrap(Work, "missing", "c")
        assert Work().outer() == 2
    # clock: outer starts 0, inner 1..2 (1 s), outer ends 3: outer 3 s inclusive, 2 s exclusive
    assert dict(t.seconds) == {"a": 2.0, "b": 1.0}
    assert t.missing == ["Work.missing"]
    assert Work.__dict__["outer"] is original  # restored on exit


def _record(cache, step, batch=8, context=8192, budget=None, kept=8192, floor=None):
    return {
        "context": context,
        "batch": batch,
        "cache": cache,
        "kept_tokens": kept,
        "budget": budget,
        "step_s": {"median": step},
        "round_median_step_s": [step, step],
        "floor_s": floor,
    }


def test_target_verdicts_from_ratios():
    from benchmarks.cachebench.decode import add_ratios

    recs = [_record("stock", 1.2), _record("h2o@0.2", 0.15, floor=0.12), _record("recency@0.2", 0.14)]
    add_ratios(recs)
    res = {
        "decode": {"records": recs},
        "prefill": {
            "records": [
                {"label": "stock sdpa", "prefill_s": {"median": 30.0}, "peak_rss_bytes": {"median": 1.5e9}},
                {
                    "label": "kvevict h2o@0.2",
                    "prefill_s": {"median": 39.0},
                    "peak_rss_bytes": {"median": 1.8e9},
                    "job": {"context": 8192},
                },
            ]
        },
    }
    got = {t["target"]: t for t in targets.evaluate(res, "h2o", 0.2, 8192, 8)}
    speed = got["decode throughput vs stock full cache"]
    assert speed["value"] == pytest.approx(8.0) and speed["status"] == "met"
    book = got["H2O bookkeeping over recency (step time)"]
    assert book["value"] == pytest.approx(0.15 / 0.14 - 1) and book["status"] == "met"
    assert got["prefill with H2O scoring: peak RSS"]["status"] == "met"
    t = got["prefill with H2O scoring: time vs plain SDPA prefill"]
    assert t["value"] == pytest.approx(1.3) and t["status"] == "missed"
    f = got["decode step vs memory-bandwidth floor"]
    assert f["value"] == pytest.approx(1.25) and f["status"] == "met"
    empty = targets.evaluate({}, None, 0.2, 8192, 8)
    assert {t["status"] for t in empty} == {"not measured"}


def test_medians_of_an_even_count_average_the_two_middle_values():
    """Two rounds: the median of the round-wise ratios is their mean, not the upper one."""
    h, r = _record("h2o@0.2", 0.15), _record("recency@0.2", 0.10)
    h["round_median_step_s"], r["round_median_step_s"] = [0.11, 0.15], [0.10, 0.10]  # +10% and +50%
    got = {t["target"]: t for t in targets.evaluate({"decode": {"records": [h, r]}}, "h2o", 0.2, 8192, 8)}
    assert got["H2O bookkeeping over recency (step time)"]["value"] == pytest.approx(0.30)


def test_round_medians_of_4_decode_steps(monkeypatch):
    from benchmarks.cachebench import decode

    steps = iter([[4.0, 1.0, 3.0, 2.0], [9.0, 7.0, 8.0, 6.0]])
    monkeypatch.setattr(decode, "time_decode", lambda *a: (next(steps), 100))

    class Bases:
        def get(self, spec, context):
            return None

    recs = decode.run_interleaved(None, Bases(), [(64, 1, CacheSpec(STOCK))], 2, 4, log=lambda m: None)
    assert recs[0]["round_median_step_s"] == [2.5, 7.5]
    assert recs[0]["step_s"]["median"] == 5.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    return path


def test_quick_run_writes_json_markdown_plots(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVEVICT_KVPRESS_PYTHON", str(tmp_path / "no-venv" / "python"))
    out = tmp_path / "out"
    rc = main(
        ["--quick", "--model", str(tiny_dir), "--out", str(out), "--threads", "1", "--policies", "h2o,no-such-policy"]
    )
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert {"machine", "bandwidth", "decode", "maxbatch", "breakdown", "prefill", "targets"} <= set(res)
    assert res["machine"]["torch_threads"] == 1 and len(res["machine"]["load_average"]) == 3
    assert any("no-such-policy" in n for n in res["notes"])  # skipped with a note, no crash
    recs = res["decode"]["records"]
    assert {r["cache"] for r in recs} == {"stock", "kvevict-full", "h2o@0.25"}
    assert {(r["context"], r["batch"]) for r in recs} == {(64, 1), (64, 2), (128, 1), (128, 2)}
    for r in recs:
        assert r["step_s"]["n"] == 2 * 2 and len(r["round_median_step_s"]) == 2  # repeats x steps
        assert r["speedup_vs_stock"]["median"] > 0 and r["floor_s"] > 0 and r["state_bytes"] > 0
    mb = {r["cache"]: r for r in res["maxbatch"]["records"]}
    assert mb["h2o@0.25"]["batch"] >= mb["stock"]["batch"]  # a quarter of the tokens: more sequences fit
    assert {w["cache"] for w in res["breakdown"]["wall"]} == {"stock", "kvevict-full", "h2o@0.25"}
    core = {
        "attention.kvevict_attention",
        "attention.attend",
        "cache.EvictingLayer.update",
        "cache.EvictingLayer.absorb",
        "tier.Tier._replace_one",
        "policies.Policy.priority",
    }
    for w in res["breakdown"]["wall"]:  # the timed code paths still exist under these names
        assert core <= set(w["wrapped"]), core - set(w["wrapped"])
    pre = {p["label"]: p for p in res["prefill"]["records"]}
    assert set(pre) == {"stock sdpa", "stock eager", "kvevict h2o@0.25"}
    assert all(p["peak_rss_bytes"]["median"] >= p["rss_loaded_bytes"]["median"] > 0 for p in pre.values())
    assert any("kvpress peer skipped" in n for n in res["prefill"]["notes"])
    assert len(res["targets"]) == 5
    mx = res["matrix"]
    labels = {r["cache"] for r in mx["records"]}
    assert labels == {
        "stock",
        "h2o@0.2",
        "h2o/fp16@0.2",
        "h2o/int8@0.2",
        "h2o/int4@0.2",
        "memory=0.2",
        "memory=0.1",
        "kvevict-full/fp16",
        "kvevict-full/int8",
        "kvevict-full/int4",
    }
    assert {(r["threads"], r["context"], r["batch"]) for r in mx["records"]} == {
        (1, c, b) for c in (64, 128) for b in (1, 2)
    }
    bw = mx["bandwidth"]["1"]["best"]
    by = {(r["cache"], r["context"], r["batch"]): r for r in mx["records"]}
    for r in mx["records"]:
        assert r["step_s"]["n"] == 2 * 2 and r["floor_s"] == pytest.approx((res["weight_bytes"] + r["read_bytes"]) / bw)
        assert r["x_floor"] == pytest.approx(r["step_s"]["median"] / r["floor_s"])
        assert (
            r["read_bytes"] == r["batch"] * by[(r["cache"], r["context"], 1)]["read_bytes"]
        )  # batch copies of one row
    # the stock cache reads every token in fp32: 128 tokens x 3 layers x 2 KV heads x (8 + 8) dims x 4 B, per sequence
    assert by[("stock", 128, 1)]["read_bytes"] == 128 * 3 * 2 * 16 * 4
    assert (
        by[("kvevict-full/int4", 128, 1)]["read_bytes"]
        < by[("kvevict-full/int8", 128, 1)]["read_bytes"]
        < by[("kvevict-full/fp16", 128, 1)]["read_bytes"]
        < by[("stock", 128, 1)]["read_bytes"]
    )
    assert by[("stock", 64, 2)]["step_vs_stock"]["median"] == 1.0
    assert mx["kernel"].startswith("default") or mx["kernel"] in ("torch", "cpu", "auto")
    chat = {r["cache"]: r for r in mx["bytes_held"]["chat"]}
    assert chat["stock"]["state_bytes"] == (20 + 16) * 3 * 2 * 16 * 4 and chat["stock"]["vs_stock"] == 1.0
    assert chat["h2o/int4@0.2"]["state_bytes"] < chat["h2o@0.2"]["state_bytes"]
    assert {r["context"] for r in mx["bytes_held"]["long"]} == {64, 128}
    pairs = {(p["context"], p["pair"]) for p in mx["peer_comparison"]}
    assert pairs == {(c, p) for c in (64, 128) for p in ("int8/fp16", "int4/fp16")}
    assert "note" in res["llamacpp"]  # no GGUF for a local folder (and maybe no llama-bench): skipped, said why
    md = (out / "bench.md").read_text()
    for heading in (
        "## Targets",
        "## Decode",
        "## Largest batch",
        "## One decode step",
        "## Prefill",
        "## Decode-step matrix",
        "## llama.cpp peer",
    ):
        assert heading in md
    assert (out / "throughput_vs_context.png").stat().st_size > 1000
    assert (out / "memory_vs_context.png").stat().st_size > 1000
    assert (out / "matrix_steps.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--budgets", "2"], "budgets"),
        (["--sections", "decode,nope"], "section"),
        (["--contexts", "a,b"], "integers"),
        (["--matrix-threads", "0"], "matrix-threads"),
        (["--matrix-caches", "h2o@2"], "cannot read the cache"),
        (["--matrix-caches", "h2o@0.2"], "include stock"),
        (["--llama-contexts", "x"], "llama-contexts"),
    ],
)
def test_bad_arguments_are_one_clear_line(argv, msg, tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_kvpress_peer_runs_in_its_venv(tiny_dir):
    from benchmarks.cachebench.subprocess_jobs import kvpress_jobs, kvpress_python, run_jobs

    py = kvpress_python()
    if py is None:
        pytest.skip("no kvpress environment (kvevict peers setup --only kvpress; see docs/results/performance.md)")
    (rec,) = run_jobs(kvpress_jobs(py, tiny_dir, ["knorm"], 0.25, 64, 1, 1, 0), repeats=1, log=lambda m: None)
    assert "error" not in rec, rec.get("error")
    # knorm keeps 25% of the 64 prompt tokens: 16 tokens x 3 layers x 2 KV heads x (8 + 8) dims x 4 B (head_dim 64/8)
    assert rec["kv_bytes_after_prefill"]["median"] == 16 * 3 * 2 * (8 + 8) * 4


def test_kvevict_bench_says_where_the_benchmarks_went(capsys):
    """The benchmarks left the installed package: ``kvevict bench`` names the script that runs them."""
    import importlib.util

    from kvevict.cli import main as kvevict

    assert kvevict(["bench", "--quick", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "python benchmarks/bench.py ARGS" in err and "Traceback" not in err
    assert importlib.util.find_spec("kvevict.bench") is None


def test_the_script_runs_from_anywhere_with_kvevict_importable(tmp_path):
    """``python benchmarks/bench.py`` finds its own package from any folder (a bad setting: one line)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import kvevict

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
    env = dict(os.environ, PYTHONPATH=str(Path(kvevict.__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, str(script), "--stream", "--stream-tokens", "0", "--out", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == ("python benchmarks/bench.py: error: stream tokens must be a positive int, got 0.")
