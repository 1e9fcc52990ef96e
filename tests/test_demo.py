"""kvevict demo: both budgeted caches hold at most the memory share they are given, on a model
with sliding-window layers too (Gemma 3's, where a token share of the prompt held 35% at 20%), and
a base model is asked in a form it completes."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from kvevict.commands.demo import budgeted_runs, demo_prompt, h2o_tokens
from kvevict.data.passkey import passkey_prompt
from kvevict.generate import generate
from kvevict.stock import stock_kv_bytes
from tiny_chat_model import char_tokenizer

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=4096)


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return LlamaForCausalLM(cfg)  # SmolLM2's head_dim: a slot's bookkeeping as a real model's


def tiny_gemma3(window=64):
    """Gemma 3's pattern: five sliding layers to one global, one KV head of 64 dims."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


class _Base:
    """A base model's tokenizer: no chat template."""

    chat_template = None


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("memory", [0.2, 0.1])
def test_both_budgeted_caches_hold_at_most_the_share(make, memory):
    model = make().eval()
    n = 2000  # past the floor of tokens a memory plan keeps (MIN_TOKENS) at both shares
    ids = torch.randint(4, 128, (1, n), generator=torch.Generator().manual_seed(1))
    shares, tok = {}, char_tokenizer()  # kvzip-pool asks the model to repeat the prompt: a real tokenizer
    for name, kw in budgeted_runs(model, memory, n):
        r = generate(model, tok, ids, max_new_tokens=4, **kw)
        shares[name] = r.kv_bytes / r.full_kv_bytes
    assert shares["full cache (stock)"] == pytest.approx(2.0)  # fp32 against 16 bits: the denominator is right
    assert shares["plain H2O"] <= memory and shares["kvevict recommended"] <= memory
    assert shares["plain H2O"] > 0.9 * memory  # and it spends the share, not a fraction of it


def test_h2o_tokens_solve_the_bytes_with_sliding_layers():
    """The stock cache holds a sliding layer's window only, so the bytes it is compared with are
    mostly the global layer's: H2O gets the B whose slots fill them, far fewer than a fifth of the
    prompt on every layer (what held 35% on Gemma 3 at 20%)."""
    model, n, memory = tiny_gemma3(window=64), 900, 0.2
    b = h2o_tokens(model, memory, n)
    stock = stock_kv_bytes(model.config, n)
    slot = 2 * 64 * 2 + 2 + 4  # 16-bit key and value, an int16 position, H2O's float32 sum
    held = lambda b: sum(min(b, 63) if i < 5 else b for i in range(6)) * slot  # noqa: E731
    assert held(b) <= memory * stock < held(b + 1)
    assert b < memory * n / 4


def test_a_base_model_completes_the_text_and_a_chat_model_is_asked():
    task = passkey_prompt("Some filler text. " * 50, 0.5, seed=3)

    class Chat:
        chat_template = "{{ messages }}"

    base = demo_prompt(task, _Base())
    assert isinstance(base, str) and base.endswith("\n\nThe pass key is") and task.answer in base
    assert "What is the pass key" not in base  # the question made Gemma 3 go on with its words
    assert demo_prompt(task, Chat()) == task.messages
