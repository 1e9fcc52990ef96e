"""The policy a budget uses when the caller names none (``pick_policy``).

A memory budget over a prompt known before decoding (``kvevict.generate.generate``,
``kvevict.compress``) gets a prompt-scoring policy: the model's measured one where there is one
(``ONE_SHOT_OF``), else a KVzip ranking (KVzip, Kim et al. 2025: a key's score is the largest
attention it gets while the model reconstructs the context, max over the repeat's queries of
softmax(q k^T / sqrt(d))): ``kvzip-probe`` on a model with a shipped probe (``kvevict.probe``),
``kvzip-sample`` (a probe fitted to the prompt itself) on one without from ``SAMPLE_FROM`` of a 16-bit
cache, ``kvzip-pool`` below it. A prompt that streams in gets ``mas`` (the RoCo paper's mean
attention score); a token budget gets H2O. Every choice cites the measurement that made it.
"""

from __future__ import annotations

from . import probe
from .shape import text_config

PROMPT_POLICY = "kvzip-pool"  # scores the whole prompt before decoding
# KVzip's ranking from a model's probe (kvevict.probe) and the prompt's last 64 queries, where the
# model has a probe: one prefill, where kvzip-pool runs the prompt again (docs/results/probe.md)
PROBE_POLICY = "kvzip-probe"
# a model with no probe: KVzip's pass over a quarter of the prompt, the other keys scored by a probe
# fitted to that quarter in the same call, from this share of a 16-bit cache on; below it, where it
# lost 2 of SmolLM2's 15 needles at 10% that kvzip-pool kept, kvzip-pool (docs/results/probe.md)
SAMPLE_POLICY, SAMPLE_FROM = "kvzip-sample", 0.2
# scores what streams in: MAS, H2O's sum over how many queries saw the key, beat H2O on streaming LM
# at 20% and 10% of a 16-bit cache (docs/results/quality-per-byte.md) at the same bytes (n_i from positions)
STREAM_POLICY = "mas"
TOKEN_POLICY = "h2o"  # a token budget's default (no memory budget): the library's default policy


# A prompt known with its question before decoding (one answer, ``kvevict.generate``), per model where
# measured: ``model_key`` -> (policy, the smallest memory share it was measured to hold at). On
# Qwen2.5-Coder-1.5B from 20% of a 16-bit cache, Ada-SnapKV over the question (or the prompt's last
# 64 tokens) found the RULER needles the full cache found, its scores taken from the prefill itself
# (no reconstruction pass: about the full cache's time to answer); its storage there is the shipped
# plan's (``plans.SHIPPED``). Below 20% it lost multi-key needles kvzip-pool kept, so kvzip-pool
# there; SmolLM2: SnapKV lost essay needles kvzip-pool keeps at 20%, so kvzip-pool everywhere else
# (docs/results/families.md).
ONE_SHOT_OF: dict[tuple, tuple[str, float]] = {("qwen2", 28, 12, 2, 1536, 151936): ("ada-snapkv", 0.2)}


_KEY_FIELDS = tuple(
    "model_type num_hidden_layers num_attention_heads num_key_value_heads hidden_size vocab_size".split()
)


def model_key(model) -> tuple:
    """What ``ONE_SHOT_OF`` knows a model by: its architecture and shapes (not its path or dtype)."""
    config = text_config(model)
    return tuple(getattr(config, k, None) for k in _KEY_FIELDS)


def pick_policy(prompt_known: bool, memory: bool = True, model=None, share=None) -> str:
    """The policy a memory budget uses when none is named (the module's docstring); without a memory
    budget (``memory=False``: a token budget), H2O. A prompt known in advance gets the model's
    measured one-shot policy (``ONE_SHOT_OF``) where the budget ``share`` (a fraction of a 16-bit
    stock cache) is at least what it was measured at, else ``PROBE_POLICY`` where the model has a
    probe (``kvevict.probe.find``), else ``SAMPLE_POLICY`` from ``SAMPLE_FROM`` on, else
    ``PROMPT_POLICY``."""
    if not memory:
        return TOKEN_POLICY
    if not prompt_known:
        return STREAM_POLICY
    found = ONE_SHOT_OF.get(model_key(model)) if model is not None else None
    if found is not None and isinstance(share, float) and share >= found[1] - 1e-9:
        return found[0]
    if model is None:
        return PROMPT_POLICY
    if probe.find(model) is not None:
        return PROBE_POLICY
    return SAMPLE_POLICY if isinstance(share, float) and share >= SAMPLE_FROM - 1e-9 else PROMPT_POLICY
