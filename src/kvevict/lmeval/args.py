"""The ``--model_args`` of the ``kvevict`` lm-eval model: checked before the model loads, so a typo
is one clear ValueError naming what is allowed, not a TypeError from deep inside lm-eval."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..policies import POLICIES, policy_class
from ..spec import CacheSpec

# what lm-eval itself passes to every model (from --batch_size, --max_batch_size, --device)
_HARNESS = ("batch_size", "max_batch_size", "device")
# policy fields that kvevict fills itself (a prompt's question, scores recorded on the prompt)
_RECORDED = ("question", "scores", "layers")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Settings:
    pretrained: str = "smollm2-135m"  # a kvevict known name or a local Hugging Face folder
    policy: str | None = None  # an eviction policy, "full" for the stock cache; None: see policy_for
    budget: object = 0.2  # tokens kept per layer and KV head (int) or a fraction of the prompt (float)
    memory: object = None  # a budget in bytes instead (0.2, "20%", "64MiB"); see kvevict.memory
    kv_bits: int | None = None
    evicted_bits: int | None = None
    recent: int | None = None
    slack: int | None = None  # tokens evicted at once (make_cache's slack)
    prefill: str = "full"  # full, token or block (with stride)
    stride: int | None = None
    chunk: int = 32  # loglikelihood_rolling: tokens fed per forward (the cache evicts between chunks)
    batch_size: int = 1
    dtype: str = "float32"
    max_length: int | None = None  # default: the model's max_position_embeddings
    threads: int | None = None  # torch threads (default: kvevict's, $OMP_NUM_THREADS or half the cores)
    device: str | None = None
    max_batch_size: int | None = None  # lm-eval passes it for auto batching; not used
    policy_params: dict = field(default_factory=dict)  # e.g. sinks=4 for streamingllm

    def cache_params(self) -> dict:
        """Keyword arguments for make_cache besides the policy and budget."""
        out = dict(self.policy_params)
        for name in ("memory", "kv_bits", "evicted_bits", "recent", "slack"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def policy_for(self, kind: str, model=None) -> str:
        """The policy requests of type ``kind`` run: the one named, else the one the memory budget
        picks (``kvevict.default_policy.pick_policy``): the model's one-shot policy (a KVzip ranking:
        ``kvzip-probe``, ``kvzip-sample`` or ``kvzip-pool``, unless measured otherwise for ``model``) where a request's whole context is known before the cache
        decodes (``generate_until`` and ``loglikelihood``, one request per batch, full prefill),
        ``mas`` where text streams in (``loglikelihood_rolling``, batches, chunked prefill), ``h2o``
        where no memory budget is given."""
        if self.policy is not None:
            return self.policy
        from ..default_policy import pick_policy

        known = kind != "loglikelihood_rolling" and self.batch_size == 1 and self.prefill == "full"
        share = self.memory if isinstance(self.memory, float) else None
        return pick_policy(prompt_known=known, memory=self.memory is not None, model=model, share=share)

    def describe(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("device", "max_batch_size")}


OWN = tuple(f.name for f in dataclasses.fields(Settings) if f.name != "policy_params")


def _policy_fields(policy: str) -> tuple:
    """The parameters the policy's dataclass takes (``sinks``, ``window``, ...); () for 'full'."""
    if policy == "full":
        return ()
    found = policy_class(policy)
    if found is None:
        raise ValueError(
            f"unknown policy {policy!r} in model_args; choose full or one of: "
            f"{', '.join(sorted(POLICIES))} (ada-NAME: head-adaptive budgets)."
        )
    return tuple(
        f.name for f in dataclasses.fields(found[0]) if f.init and f.name not in found[1] and f.name not in _RECORDED
    )


def _int(name, value, low=1, none=False):
    if value is None and none:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model_args {name} must be an int >= {low}, got {value!r}.")
    return value


def parse_settings(kwargs: dict) -> Settings:
    """``kwargs`` (what lm-eval parsed out of ``--model_args`` plus its own batch_size/device) ->
    Settings. Anything not a setting nor a parameter of the chosen policy is a ValueError."""
    from ..budget import check_budget
    from ..prefill import check_mode

    kwargs = dict(kwargs)
    policy = str(kwargs["policy"]).lower() if kwargs.get("policy") is not None else None
    if policy is not None and policy != "full":  # a cache spec (kvevict.spec): h2o/int4@0.2, kvzip-pool@memory=0.1
        spec = CacheSpec.parse(policy)
        if spec.question or spec.policy == "oracle":
            raise ValueError(
                f"policy {policy!r} is not offered through lm-eval (the oracle needs the future, "
                "+q needs the prompt's question); choose full or one of: " + ", ".join(sorted(POLICIES)) + "."
            )
        named = spec.cache_kwargs()
        twice = sorted(k for k in named if kwargs.get(k) is not None)
        if twice:
            raise ValueError(f"policy={policy} names {', '.join(twice)} already: drop them from model_args.")
        kwargs.update(named)
        policy = kwargs["policy"] = spec.policy
    allowed_policy = _policy_fields(policy or "h2o")
    unknown = sorted(k for k in kwargs if k not in OWN and k not in allowed_policy)
    if unknown:
        extra = f"; parameters of policy {policy!r}: {', '.join(allowed_policy)}" if allowed_policy else ""
        raise ValueError(
            f"unknown model_args {', '.join(unknown)} for --model kvevict; allowed: "
            f"{', '.join(a for a in OWN if a not in _HARNESS[1:])}{extra}."
        )
    own = {k: v for k, v in kwargs.items() if k in OWN}
    s = Settings(**own, policy_params={k: v for k, v in kwargs.items() if k in allowed_policy})
    s.policy = policy
    s.pretrained = str(s.pretrained)
    if s.policy != "full" and s.memory is None:
        check_budget(s.budget)
    if s.memory is not None:
        from ..memory import parse_memory

        parse_memory(s.memory)
    if s.kv_bits is not None or s.evicted_bits is not None:
        from ..storage import Storage

        Storage(kv_bits=s.kv_bits, evicted_bits=s.evicted_bits)
    if s.policy == "full" and (s.memory is not None or s.kv_bits is not None or s.evicted_bits is not None):
        raise ValueError("policy=full is the stock cache: it takes no memory, kv_bits or evicted_bits.")
    check_mode(s.prefill, s.stride)
    if isinstance(s.batch_size, str) and s.batch_size.startswith("auto"):
        raise ValueError("batch_size auto is not supported by --model kvevict: give an int (1 is exact per request).")
    s.batch_size = _int("batch_size", s.batch_size)
    s.chunk = _int("chunk", s.chunk)
    s.recent = _int("recent", s.recent, low=0, none=True)
    s.max_length = _int("max_length", s.max_length, low=2, none=True)
    s.threads = _int("threads", s.threads, none=True)
    if s.dtype not in DTYPES:
        raise ValueError(f"model_args dtype must be one of {', '.join(DTYPES)}, got {s.dtype!r}.")
    return s
