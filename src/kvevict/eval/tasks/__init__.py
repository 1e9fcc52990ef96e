"""The evaluation tasks, by name. Each module defines one Task subclass."""

from __future__ import annotations

from .base import Sample, Task
from .continuation import ContinuationTask
from .needles_once import NeedleOnceTask, VarTrackTask
from .piqa import PIQATask
from .ppl import PerplexityTask
from .qa import NarrativeQATask
from .reconstruction import ReconstructionTask
from .retrieval import RetrievalTask
from .ruler import RulerTask, ruler_task_classes
from .summarization import XSumTask

TASKS: dict[str, type[Task]] = {
    t.name: t
    for t in (
        PerplexityTask,
        RetrievalTask,
        XSumTask,
        ReconstructionTask,
        NarrativeQATask,
        PIQATask,
        NeedleOnceTask,
        VarTrackTask,
        ContinuationTask,
        *ruler_task_classes(),
    )
}


def task_names(requested: str) -> list[str]:
    """Task names from ``"ppl,passkey"`` or ``"all"``; unknown ones are a ValueError listing the known."""
    items = [t.strip().lower() for t in requested.split(",") if t.strip()]
    if items == ["all"]:  # RULER's tasks are long: named, never in "all"
        return [t for t in TASKS if not t.startswith("ruler-")]
    bad = [t for t in items if t not in TASKS]
    if bad or not items:
        raise ValueError(
            f"unknown task {', '.join(map(repr, bad)) or '(none given)'}; known tasks: {', '.join(TASKS)} (or 'all')."
        )
    return list(dict.fromkeys(items))


__all__ = ["TASKS", "ContinuationTask", "RulerTask", "Sample", "Task", "task_names"]
