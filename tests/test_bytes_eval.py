"""Evaluation plumbing: cells that name their storage, and quality against bytes."""

import pytest
import torch

import kvevict
from conftest import tiny_model
from kvevict.eval.bytes_report import pareto, rows
from kvevict.eval.caches import new_cache, policy_names
from kvevict.eval.runner import cells_for
from kvevict.spec import CacheSpec
from kvevict.storage import Storage


def test_cache_specs_name_their_storage():
    assert CacheSpec.parse("h2o/int8+int4") == CacheSpec("h2o", Storage(kv_bits=8, evicted_bits=4))
    assert CacheSpec.parse("full/int4") == CacheSpec("full", Storage(kv_bits=4))
    assert CacheSpec.parse("snapkv") == CacheSpec("snapkv") and CacheSpec.parse("snapkv").storage is None
    assert Storage(kv_bits=4, evicted_bits=2).label == "int4+int2" and Storage(evicted_bits=4).label == "fp+int4"
    with pytest.raises(ValueError, match="kv_bits must be one of 16, 8, 4, 2"):
        CacheSpec.parse("h2o/int3")
    with pytest.raises(ValueError, match="unknown storage 'q4'"):
        CacheSpec.parse("h2o/q4")
    with pytest.raises(ValueError, match="unknown policy 'nope/int4'"):
        policy_names("h2o,nope/int4", kvevict.POLICIES)
    assert policy_names("h2o/int4,full/int8", kvevict.POLICIES) == ["h2o/int4", "full/int8"]
    # a memory cell at bits no plan spends is refused when the grid is parsed, naming the cell
    assert policy_names("mem,mem-h2o/int4,mem-kvzip-pool/int8+int4", kvevict.POLICIES)[1:] == [
        "mem-h2o/int4",
        "mem-kvzip-pool/int8+int4",
    ]
    with pytest.raises(ValueError, match="'mem-h2o/int2': a memory cell is spent at int8, int4"):
        policy_names("h2o,mem-h2o/int2", kvevict.POLICIES)
    # a storage that evicts nothing is one cell whatever the budgets
    assert cells_for(["full/int4", "h2o/int4"], [0.1, 0.2]) == [
        ("full", None),
        ("full/int4", None),
        ("h2o/int4", 0.1),
        ("h2o/int4", 0.2),
    ]


def test_full_with_a_storage_keeps_every_token_quantized():
    model = tiny_model("llama-gqa")
    seq = torch.randint(0, 128, (1, 30))
    cache = new_cache(model, "full/int8", None, sequence=seq)
    with torch.no_grad():
        model(seq, cache=cache)
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.uint8 and layer.budget == 30 and layer.evicted == 0
    with pytest.raises(ValueError, match="keeps every token"):
        new_cache(model, "full/int8", None)


def test_generate_runs_a_storage_spec_and_reports_it(real_model):
    model, tok = real_model
    from kvevict.generate import generate

    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = generate(model, tok, msgs, "full", None, max_new_tokens=8)
    q = generate(model, tok, msgs, "full/int8", None, max_new_tokens=8)
    assert q.text == full.text and q.policy == "full/int8" and q.storage.startswith("int8, ")
    assert q.kv_bytes < 0.57 * q.full_kv_bytes  # int8: 140 bytes a token and KV head against 256 at 16 bits
    m = generate(model, tok, msgs, "h2o", None, max_new_tokens=8, memory=0.2)
    assert m.text == full.text  # a short prompt stays whole, at 16 bits (kvevict.memory.MIN_TOKENS)
    kept, seen = (int(x) for x in m.storage.split(", ")[1].removesuffix(" tokens").split(" of "))
    assert m.storage.startswith("fp16, ") and kept == seen == m.prompt_tokens + 7
    # 20% of a 16-bit stock cache on a 1,000-token prompt: H2O's top tokens at int8, the next at int4
    long = generate(
        model, tok, "The quick brown fox jumps over the lazy dog. " * 100, "h2o", None, max_new_tokens=2, memory=0.2
    )
    assert long.storage.startswith("int8+int4, ") and long.kv_bytes <= 0.2 * long.full_kv_bytes * 1.02


def _row(policy, share, diff, higher=True, n=5):
    return {
        "task": "t",
        "metric": "m",
        "policy": policy,
        "budget": None,
        "bytes": share,
        "mean": 0.0,
        "ref_mean": 0.0,
        "diff": diff,
        "lo": diff - 0.1,
        "hi": diff + 0.1,
        "n": n,
        "higher_is_better": higher,
    }


def test_pareto_front_is_what_nothing_beats_on_bytes_and_quality():
    rs = [
        _row("a", 0.10, -0.5),
        _row("b", 0.20, -0.1),
        _row("c", 0.20, -0.3),
        _row("d", 0.30, -0.1),
        _row("e", 0.05, -0.9),
    ]
    assert pareto(rs) == {0, 1, 4}  # c loses to b (same bytes, worse); d to b (more bytes, same quality)
    low = [_row("a", 0.1, +0.5, higher=False), _row("b", 0.2, +0.1, higher=False), _row("c", 0.3, +0.2, higher=False)]
    assert pareto(low) == {0, 1}  # lower is better (NLL): c costs more and loses more


def test_rows_pair_each_cell_with_the_full_cache_on_shared_samples():
    recs = []
    for s, (full, h2o, q) in enumerate([(1, 0, 1), (1, 1, 1), (0, 0, 1)]):
        for policy, budget, em, kb in (("full", None, full, 100), ("h2o", 0.2, h2o, 20), ("full/int4", None, q, 18)):
            recs.append(
                {
                    "model": "m",
                    "task": "passkey",
                    "policy": policy,
                    "budget": budget,
                    "sample": str(s),
                    "scores": {"em": em},
                    "kv_bytes": kb,
                    "full_kv_bytes": 100,
                    "bytes_basis": "stock16",
                }
            )
    got = {r["policy"]: r for r in rows(recs)}
    assert got["h2o"]["diff"] == pytest.approx(-1 / 3) and got["h2o"]["bytes"] == pytest.approx(0.2)
    assert got["full/int4"]["diff"] == pytest.approx(1 / 3) and got["full/int4"]["n"] == 3
    # an old record (no bytes_basis) counted the full cache in the model's dtype (fp32): rescaled to 16 bits
    old = [{k: v for k, v in r.items() if k != "bytes_basis"} for r in recs]
    assert {r["policy"]: r for r in rows(old)}["h2o"]["bytes"] == pytest.approx(0.4)
    assert {r["policy"]: r for r in rows(old, legacy_dtype_bytes=2)}["h2o"]["bytes"] == pytest.approx(0.2)


def test_a_kvpress_cell_counts_its_kept_prompt_tokens_at_16_bits():
    recs = []
    for s, prompt in enumerate((1000, 2000)):
        recs.append(
            {
                "task": "t",
                "policy": "full",
                "budget": None,
                "sample": str(s),
                "scores": {"em": 1},
                "prompt_tokens": prompt,
                "kv_bytes": 4 * prompt,
                "full_kv_bytes": 2 * prompt,
            }
        )
        recs.append(
            {
                "task": "t",
                "policy": "kvpress-snapkv",
                "budget": 0.2,
                "sample": str(s),
                "scores": {"em": s},
                "kv_tokens": prompt // 5 + s * prompt // 10,
            }
        )
    (got,) = rows(recs)
    assert got["bytes"] == pytest.approx((0.2 + 0.3) / 2) and got["diff"] == pytest.approx(-0.5)


def test_new_records_say_their_bytes_are_against_a_16_bit_stock_cache(tmp_path):
    from kvevict.eval import records

    w = records.Writer(tmp_path)
    w.write(
        {"model": "m", "task": "t", "policy": "h2o", "budget": 0.2, "sample": "0", "kv_bytes": 1, "full_kv_bytes": 5}
    )
    w.close()
    (rec,) = records.load(tmp_path).values()
    assert rec["bytes_basis"] == records.BASIS == "stock16"


def test_storage_pilot_configs_parse_or_say_what_is_wrong():
    from kvevict.eval.storage_pilot import parse_config

    assert parse_config("mix:kv_bits=8,evicted_bits=4,budget=0.2") == (
        "mix",
        {"kv_bits": 8, "evicted_bits": 4, "budget": 0.2},
    )
    assert parse_config("m:kv_bits=8,budget=0.1,evicted_bits=4,evicted_budget=0.474")[1]["evicted_budget"] == 0.474
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        parse_config("bad:bits=4")
    with pytest.raises(ValueError, match="budget takes float values, got 'x'"):
        parse_config("bad:budget=x")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--kv-bits", "3", "--prompt", "x"], "kv_bits must be one of 16, 8, 4, 2"),
        (["generate", "--evicted-bits", "1", "--prompt", "x"], "evicted_bits must be one of"),
        (["generate", "--memory", "lots", "--prompt", "x"], "cannot read the memory budget"),
        (["demo", "--memory", "64MiB"], "give --memory as 0.2 or 20%"),
    ],
)
def test_bad_storage_and_memory_flags_are_one_line_errors_before_the_model_loads(argv, match, capsys):
    from kvevict.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
