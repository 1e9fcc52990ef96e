"""``--model kvevict``: lm-evaluation-harness requests answered under a kvevict KV-cache budget.

Every batch of requests gets a fresh cache (``kvevict.make_cache`` with the model_args, or the stock
``DynamicCache`` for ``policy=full``); what is evicted when:

- ``loglikelihood`` (multiple choice, cloze): the context is the prompt. It enters the cache the
  ``prefill`` way (``full``: one forward over it, then each layer keeps ``budget`` tokens, so a
  float budget is that fraction of the context); the continuation is then scored one token per
  forward, the cache evicting after each as it would while decoding
  (``kvevict.eval.streaming.continuation_logprob``). ``is_greedy``: every continuation token is
  the argmax after what the cache kept.
- ``loglikelihood_rolling`` (perplexity): lm-eval's windows of ``max_length`` tokens; each window
  streams through its own cache ``chunk`` tokens per forward, evicting between chunks (the H2O
  paper's streaming language modelling); a float budget is a fraction of the window.
- ``generate_until``: the prompt enters the cache the ``prefill`` way, then ``model.generate``
  decodes, evicting after every new token, until a stop string, EOS or ``max_gen_toks``.
- Policies that score the prompt in a pass of their own (``kvzip``, ``kvzip-pool``) are recorded
  on the context / prompt before the cache is made, one request per batch.

The bytes every request's cache held (``kv_bytes()`` against ``full_kv_bytes()``, see
``caches.ByteLog``) are returned by ``get_model_info()``, which lm-eval stores in its results'
``config`` under ``kvevict``.
"""

from __future__ import annotations

import copy

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from .args import DTYPES, parse_settings
from .caches import ByteLog, needs_prompt, new_cache
from .generation import generate_batch, split_gen_kwargs
from .scoring import feed_context, left_pad, score_continuations

DEFAULT_MAX_GEN = 256
LAST = []  # the instances made in this process, newest last (the CLI wrapper prints their bytes)


@register_model("kvevict")
class KvevictLM(TemplateLM):
    def __init__(self, **kwargs):
        super().__init__()
        from ..commands._common import default_threads
        from ..models import load_model

        s = parse_settings(kwargs)
        self.settings = s
        self.threads = s.threads or default_threads()
        torch.set_num_threads(self.threads)
        device = s.device or "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's CLI passes cuda:0 unless --device is given
        self.model, self.tokenizer = load_model(s.pretrained, dtype=DTYPES[s.dtype], device=device)
        self._device = torch.device(device)
        self._rank, self._world_size = 0, 1
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._max_length = s.max_length or getattr(config, "max_position_embeddings", None) or 2048
        self.bytes = ByteLog()
        LAST.append(self)

    # -- what lm-eval asks of a model -----------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def get_model_info(self) -> dict:
        """lm-eval adds this to its results' ``config``: the settings and the bytes held."""
        return {
            "kvevict": {
                **self.settings.describe(),
                "threads": self.threads,
                "bytes": self.bytes.summary(),
                "policies": {kind: self.settings.policy_for(kind, self.model) for kind in self.bytes.kv},
            }
        }

    # -- batching ---------------------------------------------------------------------------
    def _batches(self, items: list, length, kind: str):
        """Index batches, longest first (lm-eval's order for padding), one request per batch for a
        policy that records its prompt (kvzip)."""
        size = 1 if needs_prompt(self.settings.policy_for(kind, self.model)) else self.settings.batch_size
        order = sorted(range(len(items)), key=lambda i: length(items[i]), reverse=True)
        return [order[i : i + size] for i in range(0, len(order), size)]

    def _score(
        self, pairs: list[tuple[list[int], list[int]]], kind: str, step: int, whole_is_prompt: bool, disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        out = [None] * len(pairs)
        pad = self.tokenizer.pad_token_id
        batches = self._batches(pairs, lambda p: (len(p[0]), len(p[1])), kind)  # contexts of a batch: alike lengths
        for batch in tqdm(batches, desc=f"kvevict {kind}", disable=disable_tqdm):
            ctx, mask = left_pad([pairs[i][0] for i in batch], pad)
            conts = [pairs[i][1] for i in batch]
            cache = new_cache(self.model, self.tokenizer, self.settings, kind, prompt=ctx if len(batch) == 1 else None)
            whole = ctx.shape[1] + max(map(len, conts)) if whole_is_prompt else None
            last = feed_context(self.model, cache, ctx, mask, self.settings.prefill, self.settings.stride, whole)
            for i, res in zip(batch, score_continuations(self.model, cache, last, mask, conts, pad, step)):
                out[i] = res
            self.bytes.add(kind, cache, len(batch))
        return out

    # -- the three request types ------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = []
        for _, ctx, cont in requests:
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens is longer than max_length {self.max_length}.")
            cut = max(0, len(ctx) + len(cont) - (self.max_length + 1))  # as lm-eval's HFLM: the context's oldest go
            pairs.append((ctx[cut:] or ctx[-1:], cont))
        return self._score(pairs, "loglikelihood", 1, False, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for r, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for w in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(r)
        scores = self._score(windows, "loglikelihood_rolling", self.settings.chunk, True, disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scores):
            totals[r] += lp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        items = []
        for req in requests:
            context, gen_kwargs = req.args
            until, max_new, kw = split_gen_kwargs(copy.deepcopy(gen_kwargs), DEFAULT_MAX_GEN, eos)
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new) :]
            items.append((ids, until, max_new, kw))
        out = [None] * len(items)
        groups = {}
        for i, (_, until, max_new, kw) in enumerate(items):  # a batch shares one set of generation kwargs
            groups.setdefault(repr((until, max_new, sorted(kw.items()))), []).append(i)
        batches = []
        for idx in groups.values():
            batches += [
                [idx[j] for j in b]
                for b in self._batches([items[i] for i in idx], lambda it: len(it[0]), "generate_until")
            ]
        s = self.settings
        for batch in tqdm(batches, desc="kvevict generate_until", disable=disable_tqdm):
            prompts = [items[i][0] for i in batch]
            _, until, max_new, kw = items[batch[0]]
            prompt = torch.tensor(prompts) if len(batch) == 1 else None
            cache = new_cache(self.model, self.tokenizer, s, "generate_until", prompt=prompt)
            texts = generate_batch(self.model, self.tokenizer, cache, prompts, until, max_new, kw, s.prefill, s.stride)
            for i, text in zip(batch, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            self.bytes.add("generate_until", cache, len(batch))
        return out
