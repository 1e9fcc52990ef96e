"""Server-wide settings: the defaults a request falls back on, and the limits of batching and memory."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30


@dataclass
class Settings:
    model_id: str  # the name /v1/models lists and requests must ask for
    policy: str = "h2o"  # default kv_policy ("full" = no eviction)
    # default kv_budget: int tokens per layer & KV head, a fraction of the prompt, or None = the
    # server's per-sequence share of kv_memory (kv_memory / min(max_batch, budget_share)), so that a
    # sequence is evicted only when it outgrows the memory the server gives it; short chats are kept
    # whole, and hold only their own pages (storage grows as a sequence does)
    budget: int | float | None = None
    recent: int | None = None  # default recent window (None: the policy's default)
    max_tokens: int = 128  # when a request gives no max_tokens
    max_tokens_limit: int = 4096  # the most a request may ask for
    # sequences running at once (vLLM's max_num_seqs default): how many fit is kv_memory's to say,
    # since short chats hold only their own pages
    max_batch: int = 256
    budget_share: int = 16  # the default budget lets this many sequences hold it at once
    kv_memory: int = 2 * GiB  # K/V bytes the server may hold at once; requests that do not fit wait
    min_budget: int = 64  # a fractional budget keeps at least this many tokens (never a handful)
    # A float budget resolves to a token count per prompt; rounding it up to a multiple of
    # budget_round gives prompts of similar length one budget (rows of any budgets share a batch,
    # but each layer is as wide as the batch's largest: equal budgets waste no slots).
    budget_round: int = 1
    # bits per key/value channel of every budgeted row's storage: None (the model's dtype), 16, 8
    # or 4 (packed codes read by the fused kernels, kvevict.storage.codes); full-cache rows keep the dtype.
    # int8: at the same K/V memory it served about twice H2O fp32's tokens/s, at the same quality
    # (int8 at the same tokens costs +0.0002 nats per token; docs/results/serving.md, "Packed storage")
    kv_bits: int | None = 8
    # -- hosting: API keys, a bounded queue, request timeouts --
    # every /v1 route asks for "Authorization: Bearer <api_key>" (None: open; several keys: any of
    # them, each its own owner of stored prefixes); repr=False keeps it out of logs and tracebacks
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    protect_metrics: bool = False  # /metrics asks for the key too (it tells request counts and memory)
    # requests waiting for memory or a batch slot; one more gets 429 with Retry-After at once, so
    # overload is answered instead of growing an unbounded queue (and its clients' latency)
    max_queue: int = 1024
    # seconds from arrival to the last token; past it the request ends with 504 and frees what it held
    request_timeout: float | None = None
    # -- prefix caching (``prefix_store``) --
    # bytes of K/V the store of prompt prefixes may hold (0: off). A part of kv_memory, not beside it:
    # admission counts the store, and a waiting request that does not fit makes it give up prefixes
    prefix_cache_memory: int = 0
    # with API keys, whether one key's stored prefixes serve another key's requests (default: never)
    prefix_cache_shared: bool = False


def api_keys(settings: Settings) -> tuple[str, ...]:
    """The keys a /v1 request may carry (none: the server is open)."""
    key = settings.api_key
    return () if not key else (key,) if isinstance(key, str) else tuple(key)
