"""The CLI and the server default to a thread count that does not stall next to
a busy process (half the cores, or $OMP_NUM_THREADS), and say so."""

import argparse
import os

import torch
from benchmarks.threads import table

from kvevict.cli import main
from kvevict.commands._common import default_threads, setup_threads


def test_default_is_half_the_usable_cores_or_omp_num_threads(monkeypatch):  # conftest restores the threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_threads() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    assert setup_threads(argparse.Namespace(threads=None)) == 3 and torch.get_num_threads() == 3
    assert setup_threads(argparse.Namespace(threads=2)) == 2 and torch.get_num_threads() == 2


def test_bad_threads_is_one_line(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_table_gives_ratios_against_the_first_count():
    res = {
        "cores": 2,
        "context": 512,
        "rounds": 3,
        "steps": 5,
        "rows": [
            {"busy": 1, "threads": 1, "step_s": 0.05, "vs_first": 1.0},
            {"busy": 1, "threads": 2, "step_s": 1.5, "vs_first": 30.0},
        ],
    }
    md = table(res, "python benchmarks/threads.py")
    assert "| 1 | 2 | 1500.0 | 30.00x |" in md and "vs 1 thread(s)" in md
