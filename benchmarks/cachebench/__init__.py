"""The pieces of ``python benchmarks/bench.py``: decode speed, memory and prefill cost of budgeted
caches against the stock full cache (and kvpress, in its own environment), measured interleaved in
one process so that machine noise hits every configuration alike. Entry point: ``run.run_bench``.

``prefill_child.py`` and ``kvpress_peer.py`` run as scripts in processes of their own (the latter in
kvpress's environment): they import only their siblings ``child_measure`` and ``loading`` (and kvevict)."""
