"""Fitting a model's KVzip probe (``kvevict calibrate --probe``; the probe is ``kvevict.probe``).

Each calibration text is essay text (from essay ``START`` on, which no shipped task or the demo
cuts its haystack from: they start at essays 0-6) with one to three short facts of varied forms
set at random depths (a code, a number, a word), so the probe sees what a later question may ask
for. Per text: one prefill into a stock cache, KVzip's scores by reconstruction on top of it
(``KVzip.record``), and per layer the probe's features of the cached keys and values (their
positions' bands included, ``kvevict.probe.EDGES``) against the scores' logs. A sliding layer is
fitted and judged on the keys of its window only (the last W - 1, what a stock cache holds there): a
key before it is in no cache, and its KVzip score is 0 for where it sits, not for what it says.
The ridge fit is per layer; texts held out after the fitted ones report how well the
probe ranks: the Spearman correlation of its scores with KVzip's, and the share of KVzip's top 20%
of keys (per layer and KV head) that the probe's top 20% holds."""

from __future__ import annotations

import random

import torch

from ..data.essays import haystack
from ..data.passkey import insert_at
from ..plans import signature
from ..policies.kvzip import KVzip
from ..probe import EDGES, EPS, Probe, features, fit
from ..stock import stock_windows

START = 24  # the first essay the calibration texts are cut from
FACTS = (
    "The secret code for the {w} vault is {n}.",
    "Remember: the {w} number is {n}.",
    "Note that {w}'s phone extension is {n}.",
    "The magic word for {w} is {x}.",
    "In {w}, the meeting was moved to room {n}.",
)
WORDS = ("red", "orchard", "Lisbon", "falcon", "copper", "harbor", "meadow", "violet", "Nadia", "Tokyo")


def calibration_ids(tokenizer, tokens: int, index: int) -> torch.Tensor:
    """Text ``index`` of the calibration set: (1, about ``tokens``) ids of essay text with 1-3 facts."""
    r = random.Random(index)
    text = haystack(tokenizer, tokens, start=START + index)
    for _ in range(r.randint(1, 3)):
        fact = r.choice(FACTS).format(
            w=r.choice(WORDS), n=r.randint(100, 999999), x="".join(r.choice("bcdfghjklmnpqrstvwxz") for _ in range(6))
        )
        text = insert_at(text, r.random(), f" {fact} ")
    return tokenizer(text, return_tensors="pt")["input_ids"]


@torch.no_grad()
def observe(model, tokenizer, ids: torch.Tensor) -> tuple[list, list]:
    """Per layer, the probe's features (n, F) of one prompt and KVzip's log scores (n, hkv)."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    context = DynamicCache()  # every layer keeps every key (a sliding layer too), as KVzip scores them
    model(ids, cache=context, use_cache=True, logits_to_keep=1)
    scores = KVzip.record(model, tokenizer, ids, context=context).scores
    assert scores is not None  # record fills them
    xs = [features(layer.keys, layer.values, EDGES)[0] for layer in context.layers]
    ys = [torch.log(s[0].float().T + EPS) for s in scores]
    kept = [len(y) if w is None else w for y, w in zip(ys, stock_windows(model.config))]  # a stock cache's
    return [x[-k:] for x, k in zip(xs, kept)], [y[-k:] for y, k in zip(ys, kept)]


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(0).argsort(0).double()


def agreement(pred: torch.Tensor, true: torch.Tensor) -> tuple[float, float]:
    """(Spearman correlation, top-20% overlap) of two (n, hkv) score sets, averaged over the heads."""
    a, b = ranks(pred), ranks(true)
    a, b = a - a.mean(0), b - b.mean(0)
    rho = ((a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-12)).mean()
    k = max(1, len(pred) // 5)
    top_p, top_t = pred.topk(k, dim=0).indices, true.topk(k, dim=0).indices
    hit = [len(set(top_p[:, h].tolist()) & set(top_t[:, h].tolist())) / k for h in range(pred.shape[1])]
    return float(rho), sum(hit) / len(hit)


def fit_probe(model, tokenizer, tokens: int = 1024, texts: int = 8, heldout: int = 2, ridge: float = 1.0, log=print):
    """(the model's probe, {"spearman", "top20"} on the held-out texts)."""
    if tokens < 64 or texts < 1 or heldout < 0 or ridge <= 0:
        raise ValueError("a probe needs --tokens >= 64, --windows >= 1 texts, held-out texts >= 0 and a ridge > 0.")
    xs: list = []
    ys: list = []
    for i in range(texts):
        ids = calibration_ids(tokenizer, tokens, i)
        x, y = observe(model, tokenizer, ids)
        xs = x if not xs else [torch.cat([a, b]) for a, b in zip(xs, x)]
        ys = y if not ys else [torch.cat([a, b]) for a, b in zip(ys, y)]
        log(f"calibration text {i + 1}/{texts}: {ids.shape[1]} tokens")
    weights = fit(xs, ys, ridge)
    probe = Probe(
        weights, signature(model), f"{texts} texts of {tokens} tokens from essay {START} on, ridge {ridge}", EDGES
    )
    rho, top = [], []
    for i in range(texts, texts + heldout):
        x, y = observe(model, tokenizer, calibration_ids(tokenizer, tokens, i))
        for layer, (xl, yl) in enumerate(zip(x, y)):
            w = weights[layer]
            r, t = agreement(xl @ w[:-1] + w[-1], yl)
            rho.append(r)
            top.append(t)
    held = {"spearman": sum(rho) / len(rho), "top20": sum(top) / len(top)} if rho else {}
    return probe, held
