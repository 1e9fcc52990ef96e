"""benchmarks/gpu_generate.py on a CPU with tiny shapes: what it writes, and the batch it fills
from prompts entered a few rows at a time (never for speed: speed lives in its own output)."""

import json

import torch
from benchmarks import gpu_generate as gg


def test_a_tiny_run_writes_every_configuration_with_its_ratio_to_stock(tmp_path):
    out = tmp_path / "g.json"
    code = gg.main(
        ["--tiny", "--device", "cpu", "--rounds", "2", "--caches", "stock;h2o@0.5", "--check", "h2o/int8@0.5",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    got = {(r["context"], r["batch"], r["cache"]): r for r in report["runs"]}
    assert set(got) == {(n, b, c) for n in (64, 128) for b in (1, 2) for c in ("stock", "h2o@0.5")}
    for (n, b, cache), row in got.items():
        assert len(row["runs"]) == 2  # the warm-up round is kept, the median is of the other
        if cache == "stock":
            assert row["prefill_x"] == row["tps_x"] == 1.0
            # the stock cache holds every token fed: the prompt, then all but the last new one
            assert row["cache_bytes_after_prompt"] == 2 * 2 * 2 * 16 * (n - 1) * b * 2
        else:
            assert row["cache_bytes_end"] < got[(n, b, "stock")]["cache_bytes_end"]
    check = report["check"]["h2o/int8@0.5"]
    assert check["backend"] == "cpu" and check["of"] == 8 and 0 <= check["tokens_equal_from_start"] <= 8


def test_rows_entered_a_few_at_a_time_make_one_batch_that_decodes():
    class Args:
        model, tiny, layers = "", True, 0

    model = gg.build_model(Args, torch.device("cpu"))
    from kvevict.storage import Pools

    for spec in ("stock", "h2o/int8@0.5"):
        gen = torch.Generator().manual_seed(0)
        pages = None if spec == "stock" else Pools()
        cache, ids = gg.fill_rows(model, spec, 5, 2, 32, gen, torch.device("cpu"), pages)
        assert ids.shape == (5, 32)
        if spec == "stock":
            assert all(layer.keys.shape[0] == 5 and layer.keys.shape[2] == 31 for layer in cache.layers)
        else:
            assert cache.layers[0].n_real.shape[0] == 5
        assert gg.decode(model, cache, ids, 3).shape == (5, 35)


def test_the_compiled_baseline_is_a_static_cache_with_room_for_the_answer():
    from transformers import StaticCache

    class Args:
        model, tiny, layers = "", True, 0

    model = gg.build_model(Args, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    cache = gg.fill(model, gg.STATIC, ids)
    assert isinstance(cache, StaticCache) and cache.get_seq_length() == 19
    assert cache.get_max_length() == 20 + gg.STATIC_ROOM
    # its bytes are what it allocated up front, the whole room
    assert gg.cache_bytes(cache) == 2 * 2 * 2 * 16 * (20 + gg.STATIC_ROOM) * 2 * 2
