"""Scores of one sample. Each takes plain Python / torch values and returns a float."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from functools import lru_cache

import torch


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """PPL = exp(sum_t -log p(x_t | x_<t) / n)."""
    if n_tokens <= 0:
        raise ValueError("perplexity needs at least one scored token.")
    return math.exp(nll_sum / n_tokens)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position; logits (n, vocab), targets (n,)."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


def top1_agreement(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Per position: 1 where the argmax equals the reference's argmax (no labels needed)."""
    return (logits.argmax(-1) == ref_logits.argmax(-1)).float()


def kl_divergence(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Per position KL(ref || p) = sum_v ref(v) (log ref(v) - log p(v)), in nats."""
    lr = torch.log_softmax(ref_logits.float(), -1)
    lp = torch.log_softmax(logits.float(), -1)
    return (lr.exp() * (lr - lp)).sum(-1)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answer: str) -> float:
    """1.0 when the answer (e.g. a pass key) appears in the output, else 0.0."""
    return float(answer.strip() in prediction)


def token_f1(prediction: str, references) -> float:
    """SQuAD/NarrativeQA token F1, the max over the references:
    F1 = 2 P R / (P + R), P = |common| / |pred tokens|, R = |common| / |ref tokens|."""
    refs = [references] if isinstance(references, str) else list(references)
    pred = normalize_answer(prediction).split()
    best = 0.0
    for ref in refs:
        gold = normalize_answer(ref).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold or common == 0:
            f1 = float(pred == gold)
        else:
            p, r = common / len(pred), common / len(gold)
            f1 = 2 * p * r / (p + r)
        best = max(best, f1)
    return best


@lru_cache(maxsize=1)
def _rouge_scorer():
    """One scorer for the process: building it loads the stemmer and tokenizer every time."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (Lin, 2004) with Porter stemming, via ``rouge-score``."""
    s = _rouge_scorer().score(reference, prediction)
    return {k: s[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")}


def bleu(prediction: str, reference: str) -> float:
    """Sentence BLEU (Papineni et al., 2002) in [0, 100], sacrebleu's default smoothing (exp)."""
    import sacrebleu

    return sacrebleu.sentence_bleu(prediction, [reference]).score
