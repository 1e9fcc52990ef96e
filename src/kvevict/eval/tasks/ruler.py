"""RULER's needle-in-a-haystack tasks (``ruler-niah_single_1``, ...) and its aggregation tasks
(``ruler-vt``, ``ruler-cwe``, ``ruler-fwe``: lm-eval's ``ruler_vt``, ...), their samples made by
lm-eval's own generators (``kvevict.data.ruler``), prompted as lm-eval prompts them (the raw text and
the answer's start, no chat template) and scored by RULER's ``string_match_all``. In the eval grid
they run beside kvpress's presses on the same samples (``--peer kvpress``)."""

from __future__ import annotations

from ...data.ruler import OTHER_TASKS, ruler_samples, string_match_all
from ...data.ruler import TASKS as RULER_TASKS
from .base import GenerationTask, Sample


class RulerTask(GenerationTask):
    """Samples cycle over ``lengths`` (max_seq_length, prompt + 128 tokens); n per length."""

    subtask = ""
    metrics = {"score": "mean"}
    primary = "score"
    # lm-eval lets RULER generate 128 tokens with no stop string; the answer comes first (after the
    # gen_prefix "The special magic number for X ... is"), so 32 suffice for one value, 64 for four
    max_new_tokens = 32

    def __init__(self, lengths=(4096,)):
        self.lengths = tuple(lengths)

    def samples(self, tokenizer, n):
        per = [ruler_samples(self.subtask, tokenizer, length, -(-n // len(self.lengths))) for length in self.lengths]
        out = []
        for i in range(n):
            length = self.lengths[i % len(self.lengths)]
            s = per[i % len(self.lengths)][i // len(self.lengths)]
            # every RULER template asks on the input's last line, and the answer's start follows
            question = s["input"][s["input"].rfind("\n") + 1 :] + " " + s["gen_prefix"]
            out.append(
                Sample(
                    id=f"{length}-{i}",
                    data={
                        "messages": s["input"] + " " + s["gen_prefix"],
                        "question": question,
                        "answers": list(s["outputs"]),
                        "length": length,
                    },
                )
            )
        return out

    def max_new(self, sample, tokenizer) -> int:
        if self.subtask in OTHER_TASKS:  # lm-eval's own room: the answer is a list of 3 to 10 words
            return OTHER_TASKS[self.subtask]
        return self.max_new_tokens * (2 if len(sample.data["answers"]) > 1 else 1)

    def score(self, sample, text, reference_text):
        return {"score": string_match_all(text, sample.data["answers"])}


def ruler_task_classes() -> list[type[RulerTask]]:
    """One class per RULER task, named ``ruler-<lm-eval task name>`` (``ruler-vt`` for ``ruler_vt``)."""
    return [
        type(f"Ruler_{name}", (RulerTask,), {"name": f"ruler-{name}", "subtask": name})
        for name in (*RULER_TASKS, *OTHER_TASKS)
    ]
