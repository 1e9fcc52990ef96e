"""Endless streams. A tiny model (512 positions) streams 4x its position limit
through a compact-position cache in flat storage, scored window by window (benchmarks/cachebench/stream.py)."""

import math

import pytest
import torch
from benchmarks.bench import main
from benchmarks.cachebench.stream import STOCK, StreamSettings, new_stream_cache, run_stream

from conftest import tiny_model
from kvevict.storage import stat_bytes


def test_a_tiny_model_streams_4x_its_position_limit_in_flat_storage():
    model = tiny_model("llama-gqa")
    assert model.config.max_position_embeddings == 512
    ids = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(0))
    budget, block, window = 64, 32, 256
    cache = new_stream_cache(model, "h2o", budget)
    rows = run_stream(model, ids, cache, block, window)
    assert [r["end"] for r in rows] == [256 * k for k in range(1, 8)] + [2047]
    # per kept slot: K + V (fp32), position (int16), H2O's score sum (fp32); + n_real per layer
    slot = 2 * 8 * 4 + 2 + stat_bytes(cache.policy.stats)
    assert {r["kv_bytes"] for r in rows} == {3 * (budget * 2 * slot + 8)}  # flat from the first window on
    assert cache.peak_entries() == budget + block and cache.get_seq_length() == 2047
    assert cache.layers[0].pos.max().item() == 2046  # original positions far past 512 ...
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in rows)
    stock = new_stream_cache(model, STOCK, budget)
    grown = run_stream(model, ids, stock, block, window, limit=1024)
    per_token = 3 * 2 * 2 * 8 * 4  # layers x KV heads x (K + V) x head_dim x fp32
    assert [r["kv_bytes"] for r in grown] == [r["end"] * per_token for r in grown]  # ... the stock cache grows


def test_window_ppl_is_exp_of_the_mean_nll_of_its_tokens():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 65), generator=torch.Generator().manual_seed(1))
    rows = run_stream(model, ids, new_stream_cache(model, STOCK, 1), 16, 32)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    assert [r["end"] for r in rows] == [32, 64]
    assert rows[0]["ppl"] == pytest.approx(math.exp(nll[:32].mean().item()), rel=1e-4)
    assert rows[1]["ppl"] == pytest.approx(math.exp(nll[32:].mean().item()), rel=1e-4)


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--stream-window", "500"], "must be a multiple of the block (512)"),
        (["--stream-tokens", "0"], "stream tokens must be a positive int"),
    ],
)
def test_bad_stream_settings_are_one_line(argv, msg, tmp_path, capsys):
    assert main(["--stream", "--out", str(tmp_path)] + argv) == 2
    assert msg in capsys.readouterr().err


def test_bench_out_on_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["--quick", "--out", str(f)]) == 2
    assert "--out" in capsys.readouterr().err and f.read_text() == "x"
    assert StreamSettings().tokens == 100_000
