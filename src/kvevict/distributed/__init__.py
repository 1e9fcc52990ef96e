"""Running grids of independent items (eval samples, bench points) on local worker processes or a
Ray cluster, with one model per worker and every result merged into one JSONL file.

    from kvevict.distributed import run_grid
    run_grid(items, "kvevict.distributed.passkey_task:run", model="smollm2-135m",
             out="runs/sweep.jsonl", executor="local", workers=2)

See grid.py for the contract.
"""

from .executors import InlineExecutor, LocalExecutor, RayExecutor, make_executor
from .grid import GridSummary, item_key, read_records, run_grid

__all__ = [
    "GridSummary",
    "InlineExecutor",
    "LocalExecutor",
    "RayExecutor",
    "item_key",
    "make_executor",
    "read_records",
    "run_grid",
]
