"""A tiny chat model folder for server tests: conftest's random tiny Llama plus a character-level
tokenizer (PreTrainedTokenizerFast) with a ChatML template, saved with save_pretrained so that
``kvevict.load_model(folder)`` and ``kvevict serve --model folder`` load it like a real one."""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))  # 97 ASCII characters
    chars += [chr(c) for c in range(0xC0, 0xC0 + 128 - len(SPECIALS) - len(chars))]  # accented: 128 ids in all
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        padding_side="left",
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = TEMPLATE
    return fast


def save_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    from conftest import tiny_model

    model = tiny_model("llama-gqa", seed=seed)
    tok = char_tokenizer()
    assert len(tok) == model.config.vocab_size
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
        cfg.bos_token_id = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)
