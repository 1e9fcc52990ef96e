"""kvpress's presses by kvevict's name for them. Read by scripts that run in kvpress's own
environment (kvpress pins an older transformers than kvevict's), so this file imports nothing."""

PRESSES = {  # our name -> (kvpress class name, attention implementation it needs)
    "snapkv": ("SnapKVPress", "sdpa"),
    "expected_attention": ("ExpectedAttentionPress", "sdpa"),
    "knorm": ("KnormPress", "sdpa"),
    "observed_attention": ("ObservedAttentionPress", "eager"),  # H2O's score: needs the full attention matrix
    "streaming_llm": ("StreamingLLMPress", "sdpa"),
    "tova": ("TOVAPress", "sdpa"),
}

# Presses that keep every key and mask the evicted ones out of attention instead of removing them:
# they hold the whole prompt's bytes whatever their ratio. "adakv_X" is Ada-KV over press X's score
# (kvpress's leaderboard runs expected attention so).
MASKING = {
    "adakv_snapkv": ("AdaKVPress", "sdpa"),
    "adakv_expected_attention": ("AdaKVPress", "sdpa"),
    "kvzip": ("KVzipPress", "sdpa"),
}
