"""A GGUF by its path (llama.cpp's users hold them): ``load_model("model.gguf")`` dequantizes it
once into kvevict's cache and loads from there afterwards, with the logits transformers' own
``from_pretrained(folder, gguf_file=...)`` gives. The file is a tiny llama written here with the
``gguf`` package (Q8_0 weights, a byte-level BPE tokenizer)."""

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import kvevict
from kvevict import models
from kvevict.commands._common import load_model_args


def write_tiny_gguf(path: Path, seed: int = 0, arch: str = "llama") -> Path:
    """A 2-layer llama (4 query heads, 2 KV heads of 16 dims) with random Q8_0 weights and a
    byte-level BPE vocabulary (256 bytes, 2 merges, an end-of-text token), as llama.cpp writes one."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>"]
    vocab, hidden, ff, heads, kv, layers = len(tokens), 64, 128, 4, 2, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])  # 3: a control token
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)

    def tensor(name, *shape, quantized=True):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantized:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a)

    d = hidden // heads
    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, quantized=False)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, quantized=False)
        tensor(f"blk.{i}.attn_q.weight", heads * d, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv * d, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv * d, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * d)
        tensor(f"blk.{i}.ffn_gate.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff)
    tensor("output_norm.weight", hidden, quantized=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model, tok, text="the theme"):
    with torch.no_grad():
        return model(tok(text, return_tensors="pt").input_ids).logits


def test_a_gguf_by_its_path_converts_once_and_loads_as_transformers_does(tmp_path, cache, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tok = kvevict.load_model(str(path))
    assert "converting tiny.gguf once" in capsys.readouterr().err
    folder = models.gguf_folder(str(path))
    assert folder.parent == cache / "gguf" and (folder / "config.json").exists()
    stamp = (folder / "config.json").stat().st_mtime_ns

    again, tok2 = load_model_args(Namespace(model=str(path), dtype="float32"))  # --model path.gguf
    assert "converting" not in capsys.readouterr().err  # from the converted copy
    assert (folder / "config.json").stat().st_mtime_ns == stamp and len(list((cache / "gguf").iterdir())) == 1

    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    direct_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = direct_tok("the theme").input_ids
    assert tok("the theme").input_ids == tok2("the theme").input_ids == ids and len(ids) < len("the theme")
    want = _logits(direct, direct_tok)
    assert torch.equal(_logits(model, tok), want) and torch.equal(_logits(again, tok2), want)
    assert tok.eos_token == "<|endoftext|>" and model.config.num_key_value_heads == 2


def test_a_rewritten_file_converts_anew(tmp_path, cache, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    first, tok = kvevict.load_model(path)  # a Path too
    path.unlink()
    write_tiny_gguf(path, seed=1)
    second, _ = kvevict.load_model(str(path))
    assert capsys.readouterr().err.count("converting") == 2 and len(list((cache / "gguf").iterdir())) == 2
    assert not torch.equal(_logits(first, tok), _logits(second, tok))


def test_bad_gguf_paths_say_what_to_change(tmp_path, cache):
    with pytest.raises(ValueError, match=r"no GGUF file at .*missing\.gguf.*give the path of a \.gguf file"):
        kvevict.load_model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model " * 10)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        kvevict.load_model(str(junk))
    rwkv = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv7")
    with pytest.raises(ValueError, match=r"architecture 'rwkv7' that transformers cannot load.*Give a GGUF of"):
        kvevict.load_model(str(rwkv))
    assert not list((cache / "gguf").iterdir())  # nothing half-converted is left to load later


def test_without_the_gguf_package_it_says_what_to_install(tmp_path, cache, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ValueError, match=r'pip install "gguf>=0.10"'):
        kvevict.load_model(str(path))
