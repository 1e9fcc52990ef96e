"""The Triton programs behind ``kvevict.kernels.triton_decode`` (imports triton: load it only
through ``triton_decode``, which checks that triton is there first).

Split-K decode attention (FlashDecoding, Dao et al. 2023): keys are cut into splits; one program
per (sequence, KV head, split) streams its keys in tiles and keeps an online softmax over them, and
``_finish`` adds the new key and merges the splits (the formulas: ``triton_softmax``).
``_split_kernel`` (``triton_split``) dequantizes its tiles in registers; ``_split_rows_kernel``
(``triton_rows``, reading codes through ``triton_words``) is the same program for packed runs read
factored. The two share the program's setup, the online softmax and the partials' stores
(``triton_softmax``); each reads and multiplies a tile its own way.
"""

from __future__ import annotations

import triton.language as tl

from .triton_rows import _split_rows_kernel
from .triton_softmax import _finish
from .triton_split import _split_kernel

__all__ = ["_finish", "_split_kernel", "_split_rows_kernel", "tl"]
