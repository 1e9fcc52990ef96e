"""kvevict's benchmarks, kept in the repository and out of the installed package: each file here is a
script (``python benchmarks/NAME.py --help``) that uses kvevict as a library; ``cachebench/`` holds
the pieces of ``bench.py``, the decode / prefill / stream benchmark of caches against the stock one."""
