"""``kvevict bench``: decode speed, memory and prefill cost of budgeted caches against the stock
full cache (and kvpress, in its own environment), measured interleaved in one process so that
machine noise hits every configuration alike. Entry point: ``kvevict.bench.run.run_bench``."""
