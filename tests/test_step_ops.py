"""The decode-step counter (``benchmarks/step_ops.py``): what counts as a launch, and one run."""

import json

import torch
from benchmarks.step_ops import is_view, main

aten = torch.ops.aten


def test_views_launch_nothing_and_in_place_or_new_results_do():
    for op in (aten.view.default, aten.slice.Tensor, aten.expand.default, aten.select.int, aten.unfold.default):
        assert is_view(op), op
    for op in (
        aten.add.Tensor,
        aten.add_.Tensor,
        aten.scatter_.src,
        aten.gather.default,
        aten._local_scalar_dense.default,
    ):
        assert not is_view(op), op


def test_a_run_counts_stock_and_a_budgeted_cache(tmp_path, capsys):
    out = tmp_path / "ops.json"
    caches = "stock;h2o/int8@0.2;h2o/int8@0.2+slack=4"
    assert main(["--caches", caches, "--layers", "2", "--prompt", "64", "--out", str(out)]) == 0
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    stock, h2o, batched = rows["stock"], rows["h2o/int8@0.2"], rows["h2o/int8@0.2+slack=4"]
    assert stock["host_reads"] == h2o["host_reads"] == batched["host_reads"] == 0
    assert (stock["steps"], h2o["steps"], batched["steps"]) == (2, 2, 8)  # averaged over 2 x slack steps
    assert 0 < stock["launches_per_layer"] < stock["ops_per_layer"]
    assert h2o["launches_x_stock"] > 1  # it quantizes and evicts as well
    assert batched["launches_per_layer"] < h2o["launches_per_layer"]  # it ranks one step in four
    assert "| `h2o/int8@0.2+slack=4` |" in capsys.readouterr().out
