"""kvevict calibrate: the plan it measures, the file it writes, and memory= reading it."""

import json
import math

import pytest
import torch

import kvevict
from conftest import tiny_model
from eval_helpers import tiny_tokenizer
from kvevict.cli import main
from kvevict.eval.calibrate import calibrate, candidates, default_path, load, save, signature
from kvevict.memory import head_from
from memory_plans import plan


@pytest.fixture(scope="module")
def calibrated():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    return model, calibrate(model, tok, (0.5, 0.2), tokens=96, windows=1, heldout=1, log=lambda m: None)


def test_candidates_spend_the_bytes_as_the_rule_does():
    got = dict(candidates(0.5, 64, 4, 2))
    assert set(got) == {"fp16", "int8", "int4", "int8+int4"}  # 0.5 lies between an int4 and an int8 slot
    for label, share in got.items():
        assert share == pytest.approx(float(plan(0.5, 64, 64, 4, 2, floor=1, kind=label).budget))
    assert got["int8"] < got["int4"] <= 1.0 and got["fp16"] < got["int8"]
    low = dict(candidates(0.2, 64, 4, 2))  # below an int4 slot: three tiers, the top at int8, the next at int4
    assert low["int8+int4"].pair[1] < low["int4"] and low["int8+int4"] + low["int8+int4"].pair[1] < 1.0


def test_calibration_picks_the_lowest_nll_and_scores_the_rule_held_out(calibrated):
    model, p = calibrated
    assert p["signature"] == signature(model) and p["policy"] == "mas"
    assert [c["memory"] for c in p["choices"]] == [0.5, 0.2]
    for c in p["choices"]:
        best = min(c["candidates"], key=lambda k: c["candidates"][k]["nll"])
        assert c["winner"] == best and c["candidates"][best]["nll"] == min(x["nll"] for x in c["candidates"].values())
        assert c["builtin"] == plan(c["memory"], 8, 8, 4, 2, group=8, floor=1, head_from=head_from("mas")).storage.label
        # the plan keeps the winner unless the rule did better on the held-out windows
        kept = c["builtin"] if c["builtin_heldout_nll"] < c["winner_heldout_nll"] else best
        assert c["storage"] == kept and c["nll"] == c["candidates"][kept]["nll"]
        assert c["heldout_nll"] == min(c["winner_heldout_nll"], c["builtin_heldout_nll"])


def test_memory_uses_a_plan_file_and_its_kind_of_storage(calibrated, tmp_path):
    model, p = calibrated
    forced = dict(p, choices=[dict(c, storage="fp16") for c in p["choices"]])
    path = save(forced, tmp_path / "plan.json")
    assert load(path, model) == json.loads(path.read_text())
    cache = kvevict.make_cache(model, "mas", memory=0.45, plan=path)  # the nearest entry: 0.5
    assert cache.storage.kv_bits == 16 and cache.storage.evicted_bits is None
    rule = kvevict.make_cache(model, "mas", memory=0.45, plan=False)
    assert (rule.storage.kv_bits, rule.storage.evicted_bits) != (16, None)
    # the plan is for mas (the default, what memory= picks for streamed text): another policy keeps the rule
    assert (
        kvevict.make_cache(model, "tova", memory=0.45, plan=path).storage
        == kvevict.make_cache(model, "tova", memory=0.45, plan=False).storage
    )


def test_the_model_s_own_plan_is_found_in_the_cache(calibrated, tmp_path, monkeypatch):
    model, p = calibrated
    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    assert kvevict.make_cache(model, "mas", memory=0.2).storage.kv_bits != 16  # no plan yet: the rule
    save(dict(p, choices=[dict(c, storage="fp16") for c in p["choices"]]), default_path(model))
    assert str(default_path(model)).startswith(str(tmp_path))
    assert kvevict.make_cache(model, "mas", memory=0.2).storage.kv_bits == 16
    assert kvevict.make_cache(model, "mas", memory=0.2, plan=False).storage.kv_bits != 16


def test_a_bad_or_stale_plan_says_to_calibrate(calibrated, tmp_path):
    model, p = calibrated
    with pytest.raises(ValueError, match="no plan file .*kvevict calibrate"):
        kvevict.make_cache(model, "mas", memory=0.2, plan=tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a kvevict plan file.*kvevict calibrate"):
        kvevict.make_cache(model, "mas", memory=0.2, plan=tmp_path / "junk.json")
    other = save(p, tmp_path / "other.json")
    with pytest.raises(ValueError, match="calibrated for another model.*kvevict calibrate"):
        kvevict.make_cache(tiny_model("llama-mha"), "mas", memory=0.2, plan=other)


def test_cli_refuses_a_memory_in_bytes(capsys):
    assert main(["calibrate", "--memory", "64MiB"]) == 2
    assert "shares of a 16-bit stock cache" in capsys.readouterr().err


def test_a_sliding_model_s_candidates_spend_the_bytes_as_memory_does():
    windows = [None] + [16] * 5  # Gemma 3's layout: five sliding layers to one global
    dense, sliding = dict(candidates(0.3, 8, 4, 2, group=8)), dict(candidates(0.3, 8, 4, 2, group=8, windows=windows))
    assert "int8+int4" in dense and "int8+int4" not in sliding  # memory= keeps int4 alone on a sliding model
    for n in (500, 2000):  # token budgets solved per layer: under the dense share, a sliding layer being cheap
        assert sliding["int4"].resolve(n) < float(dense["int4"]) * n


@pytest.fixture(scope="module")
def prompt_calibrated():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    got = calibrate(model, tok, (0.5,), "kvzip-pool", tokens=96, windows=1, heldout=1, log=lambda m: None)
    return model, tok, got


def test_a_prompt_scoring_policy_is_calibrated_on_compressed_prompts(prompt_calibrated):
    model, _, p = prompt_calibrated
    assert p["policy"] == "kvzip-pool" and p["calibration"]["on"].startswith("prompts")
    (c,) = p["choices"]
    assert set(c["candidates"]) == {label for label, _ in candidates(0.5, 8, 4, 0, group=8)}
    best = min(c["candidates"], key=lambda k: c["candidates"][k]["nll"])
    assert c["winner"] == best
    # the built-in rule's choice for a prompt-scoring policy, the one the plan is checked against
    assert c["builtin"] == plan(0.5, 8, 8, 4, 0, group=8, floor=1, scores_prompt=True).storage.label
    assert all(math.isfinite(x["nll"]) and x["nll"] > 0 for x in c["candidates"].values())


def test_memory_uses_a_prompt_scoring_policy_s_own_plan_beside_the_streaming_one(
    prompt_calibrated, tmp_path, monkeypatch
):
    from kvevict.eval.caches import new_cache

    model, tok, p = prompt_calibrated
    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    assert default_path(model, "kvzip-pool") != default_path(model)  # the streaming plan stays where it is
    prompt = torch.randint(4, 120, (1, 200), generator=torch.Generator().manual_seed(0))  # past the short-prompt floor

    def storage():
        return new_cache(model, "mem-kvzip-pool", 0.45, prompt=prompt, tokenizer=tok).storage

    rule = storage()
    forced = "fp16" if (rule.kv_bits, rule.evicted_bits) != (16, None) else "int4"
    save(dict(p, choices=[dict(c, storage=forced) for c in p["choices"]]), default_path(model, "kvzip-pool"))
    got = storage()
    assert (got.kv_bits, got.evicted_bits) == ((16, None) if forced == "fp16" else (4, None))
    # a plan written for the streaming policy does not steer the prompt-scoring one
    default_path(model, "kvzip-pool").unlink()
    save(dict(p, policy="mas", choices=[dict(c, storage=forced) for c in p["choices"]]), default_path(model))
    assert storage() == rule


def test_a_prompt_scoring_policy_cannot_be_calibrated_on_streamed_text():
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    with pytest.raises(ValueError, match="only be calibrated on prompts"):
        calibrate(model, tok, (0.5,), "kvzip-pool", tokens=96, windows=1, heldout=1, log=lambda m: None, prompt=False)


def _qwen_shapes():
    """Qwen2.5-Coder-1.5B's architecture and shapes on the meta device (no weights, no download)."""
    from benchmarks.gpu_generate import QWEN_1_5B
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**QWEN_1_5B))


def test_a_known_model_gets_the_plan_kvevict_ships_for_it(tmp_path, monkeypatch):
    """Ada-SnapKV on Qwen2.5-Coder-1.5B (its one-shot default from 20%): the shipped plan keeps int4
    alone at 20% where the built-in rule keeps three tiers; past the bytes int4 alone can spend
    (every token kept with bytes over) the rule decides; a plan of the user's own wins; a policy or
    a model the shipped plans do not name keeps the rule."""
    from kvevict.memory import plan_for_model
    from kvevict.plans import SHIPPED, shipped
    from kvevict.policies import make_policy

    monkeypatch.setenv("KVEVICT_PLANS", str(tmp_path))
    qwen, ada = _qwen_shapes(), make_policy("ada-snapkv")
    assert shipped(qwen, ada.name) is not None and (SHIPPED / "qwen2.5-coder-1.5b-adakv.json").exists()
    got = plan_for_model(qwen, 0.2, ada)
    assert got.storage.label == "int4" and plan_for_model(qwen, 0.2, ada, plan_file=False).storage.label == "int8+int4"
    assert plan_for_model(qwen, 0.5, ada).storage == plan_for_model(qwen, 0.5, ada, plan_file=False).storage
    mas = make_policy("mas")
    assert plan_for_model(qwen, 0.2, mas).storage == plan_for_model(qwen, 0.2, mas, plan_file=False).storage
    tiny = tiny_model("qwen2")
    assert shipped(tiny, ada.name) is None
    own = shipped(qwen, ada.name)
    mine = dict(own, signature=signature(qwen), choices=[dict(c, storage="int8") for c in own["choices"]])
    save(mine, default_path(qwen, ada.name))
    assert plan_for_model(qwen, 0.2, ada).storage.label == "int8"


def test_every_shipped_plan_is_a_plan_for_a_policy_kvevict_has():
    from kvevict.plans import FORMAT, KINDS, SHIPPED
    from kvevict.policies import make_policy

    files = sorted(SHIPPED.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data["format"] == FORMAT and data["choices"], path
        assert all(c["storage"] in KINDS and 0 < c["memory"] < 1 for c in data["choices"]), path
        assert any(make_policy(n).name == data["policy"] for n in ("ada-snapkv", "mas", "h2o")), path
