"""On the real SmolLM2-135M: the README's recommended call (``make_cache(model, memory=0.2)``,
and ``generate(..., memory=0.2)``) never cuts a short chat, on an fp32 and a bf16 copy."""

import torch
from transformers import DynamicCache

import kvevict
from kvevict.generate import encode_chat, generate

# every chat the server tests send, and the README's question
CHATS = [
    "What is the capital of France? Answer in one word.",
    "Go on and on.",
    "Name three colours.",
    "Never mind.",
    "Quick one?",
    "Sample me.",
    "Stop me.",
    "Talk for a long time.",
    "Tell me a story about a fox and a crow, please.",
    "count the metrics, please",
    "hello",
    "hi",
    "still there?",
]
NEW = 16


def _readme_call(model, tok, text, cache):
    """The README's example: the chat template's ids into ``model.generate`` with ``cache``."""
    ids = encode_chat(tok, [{"role": "user", "content": text}])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        do_sample=False,
        max_new_tokens=NEW,
        pad_token_id=tok.pad_token_id,
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_the_recommended_call_answers_every_short_chat_as_the_full_cache_does(real_model):
    model, tok = real_model  # fp32
    answers = {}
    for text in CHATS:
        model.set_attn_implementation("sdpa")
        full = answers[text] = _readme_call(model, tok, text, DynamicCache(config=model.config))
        cache = kvevict.make_cache(model, memory=0.2)
        assert _readme_call(model, tok, text, cache) == full, text
        assert cache.layers[0].evicted == 0 and cache.layers[0].storage.label == "fp16"
    # generate picks kvzip-probe (the prompt is known; kvevict ships SmolLM2's probe): the same answer
    known = generate(model, tok, [{"role": "user", "content": CHATS[0]}], memory=0.2, max_new_tokens=NEW)
    assert known.policy == "kvzip-probe" and known.text == answers[CHATS[0]]


def test_a_bf16_copy_keeps_short_chats_whole_and_answers_the_readme_question():
    model, tok = kvevict.load_model("smollm2-135m", dtype=torch.bfloat16)
    msgs = [{"role": "user", "content": CHATS[0]}]
    full = generate(model, tok, msgs, "full", None, max_new_tokens=12)
    rec = generate(model, tok, msgs, memory=0.2, max_new_tokens=12)
    assert full.text == rec.text == "The capital of France is Paris."
    assert rec.policy == "kvzip-probe" and rec.kv_bytes < 4 * rec.full_kv_bytes  # the probe holds whatever the dtype
    for text in CHATS[1:]:
        cache = kvevict.make_cache(model, memory=0.2)
        ids = encode_chat(tok, [{"role": "user", "content": text}])
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            do_sample=False,
            max_new_tokens=2,
            pad_token_id=tok.pad_token_id,
        )
        layer = cache.layers[0]  # the prompt and the answer kept whole, in the model's own 16 bits
        assert layer.evicted == 0 and layer.storage.kv_bits is None and layer.keys.dtype == torch.bfloat16, text


def test_a_long_prompt_is_held_to_its_share_of_the_16_bit_stock_cache(real_model):
    model, tok, memory = *real_model, 0.2
    text = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens
    r = generate(model, tok, [{"role": "user", "content": text + "\n\nWhat jumps?"}], memory=memory, max_new_tokens=4)
    assert r.policy == "kvzip-probe" and r.storage.startswith("int8+int4, ")  # three tiers at 20%
    assert 0.8 * memory * r.full_kv_bytes <= r.kv_bytes <= 1.02 * memory * r.full_kv_bytes
    kept, seen = (int(x) for x in r.storage.split(", ")[1].removesuffix(" tokens").split(" of "))
    assert kept < seen == r.prompt_tokens + r.new_tokens - 1
