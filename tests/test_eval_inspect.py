"""The attention observatory on a tiny model: exact attention, statistics that add up, the
analyses against hand-made inputs, the kept/evicted page, and `inspect_text` end to end."""

import json

import pytest
import torch

from conftest import tiny_model
from eval_helpers import essay_like, tiny_tokenizer
from kvevict.observatory import analyses, observe
from kvevict.observatory.keepmap import keep_html, kept_share
from kvevict.observatory.report import inspect_text


def test_observing_attention_is_exact_and_its_statistics_add_up(monkeypatch):
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(observe, "_CHUNK_ELEMENTS", 8 * 80 * 7)  # force several query chunks
    rec = observe.observe(model, ids, n_checkpoints=4, n_tracked=3)
    assert model.config._attn_implementation == "sdpa"  # restored
    with torch.no_grad():
        model.set_attn_implementation(observe.OBSERVE_NAME)
        observe.register()
        got = model(ids, use_cache=False).logits
        model.set_attn_implementation("sdpa")
    assert (got - want).abs().max().item() < 1e-4
    assert sorted(rec.layers) == [0, 1, 2]
    for st in rec.layers.values():
        assert 0.0 <= st.below / st.visible <= 1.0
        # every query's (head-averaged) attention sums to 1, so acc sums to the number of queries
        assert st.acc.sum().item() == pytest.approx(80, rel=1e-4)
        for t, snap in st.snapshots.items():
            assert snap.shape == (t,) and snap.sum().item() == pytest.approx(t, rel=1e-4)
        for j, i in enumerate(rec.tracked):
            assert st.traces[j, :i].abs().sum() == 0 and st.traces[j, i] > 0
    assert rec.checkpoints == [20, 40, 60, 80]


def test_power_law_slope_of_an_exact_power_law():
    acc = torch.arange(1, 501, dtype=torch.float64) ** -1.5
    assert analyses.power_law_slope(acc[torch.randperm(500)], skip=0) == pytest.approx(-1.5, abs=1e-9)


def test_heavy_hitter_overlap_by_hand():
    rec = observe.Recorder(20, [10, 20], [])
    st = observe.LayerStats()
    first = torch.zeros(10)
    first[[0, 3]] = 5.0  # top-2 of 10 keys (frac 0.2) at t = 10: {0, 3}
    later = torch.zeros(20)
    later[[0, 7]] = 9.0  # at t = 20, among keys < 10: {0, 7}: one of two survives
    st.snapshots = {10: first, 20: later}
    rec.layers[0] = st
    assert analyses.heavy_hitter_overlap(rec, 0, frac=0.2) == [(20, 0.5)]


def test_running_std_by_hand():
    std = analyses.running_std(torch.tensor([9.0, 1.0, 3.0, 5.0]), start=1)
    # std of [1], [1, 3], [1, 3, 5] (population): 0, 1, sqrt(8/3)
    assert std.tolist() == pytest.approx([0.0, 1.0, (8 / 3) ** 0.5])
    assert analyses.settle_ratio(torch.tensor([0.0, 4.0, 6.0, 7.0, 7.5, 7.6])) < 1


def test_kept_share_is_the_budget_and_keeps_the_recent_window():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    share = kept_share(model, ids, "h2o", 20, chunk=16)
    assert share.sum().item() == pytest.approx(20)  # each (layer, head) holds exactly 20 tokens
    assert (share[-10:] == 1).all()  # H2O's recent window: half the budget
    page = keep_html(["a", "<b>", "c"], torch.tensor([1.0, 0.0, 0.5]), "t")
    assert page.count("<span title=") == 3 and "&lt;b&gt;" in page


def test_inspect_text_end_to_end(tmp_path):
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    r = inspect_text(model, tok, essay_like(tok, 200), tmp_path, "h2o", 0.25, tokens=150, chunk=32)
    for name in ("sparsity.png", "power_law.png", "heavy_hitters.png", "attention_std.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "kept.html").read_text().count("<span title=") == r["tokens"]
    data = json.loads((tmp_path / "inspect.json").read_text())
    assert set(data["sparsity"]) == {"0", "1", "2"}
    assert data["mean_kept_share"] == pytest.approx(r["mean_kept_share"])
    assert "sparsity" in (tmp_path / "summary.md").read_text()
