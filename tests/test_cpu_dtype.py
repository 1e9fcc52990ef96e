"""``benchmarks/cpu_dtype.py``: one run on a tiny model folder writes a row per dtype, float32 the
baseline of its own round."""

import json

import pytest
from benchmarks.cpu_dtype import main

from tiny_chat_model import save_tiny_chat_model


def test_a_run_times_each_dtype_against_float32(tmp_path, capsys):  # conftest restores the threads main() sets
    folder = save_tiny_chat_model(tmp_path / "m")
    out = tmp_path / "dtype.json"
    main(
        [
            "--model",
            str(folder),
            "--dtypes",
            "bfloat16",
            "--tokens",
            "24",
            "--rounds",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    rows = {r["dtype"]: r for r in res["rows"]}
    assert list(rows) == ["float32", "bfloat16"]
    assert rows["float32"]["prefill_vs_float32"] == 1.0 and rows["float32"]["step_vs_float32"] == 1.0
    assert rows["bfloat16"]["prefill_s"] > 0 and rows["bfloat16"]["step_s"] > 0
    assert set(res["cpu"]) >= {"avx512_bf16", "amx_bf16"} and res["threads"] == 1
    assert "| bfloat16 |" in capsys.readouterr().out


def test_an_unknown_dtype_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--dtypes", "int8", "--out", str(tmp_path / "x.json")])
    assert "unknown dtype int8; choose from float32, bfloat16, float16" in capsys.readouterr().err
