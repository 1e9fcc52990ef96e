"""Three calls of the Triton decode kernel on the shape ``kvevict.bench.triton_decode`` times
(Llama-3-8B-shaped, 32K tokens, batch 8, int4 codes, 32 channels per group), for a profiler to
look at one of them; needs a CUDA GPU:

    ncu -k regex:_split --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        python -m kvevict.bench.triton_profile factored      # or: registers (dequantized per channel)

An optional second argument, a JSON object, is passed to ``decode_attention_triton`` as keyword
arguments (its tuning switches: ``'{"block": 64, "regs": 168}'``). Each call launches one split
program (the stored run; the new key joins in ``_finish``): the skip of 2 lands on the third
call's, compiled and warm.
"""

from __future__ import annotations

import json
import sys

import torch

from ..kernels.runs import Run
from ..kernels.triton_decode import decode_attention_triton, unknown_switches
from ..store import quantize


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "factored"
    if path not in ("factored", "registers"):
        raise SystemExit(f"the path must be factored or registers, got {path!r}.")
    try:
        tune = json.loads(argv[1]) if len(argv) > 1 else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"the second argument must be a JSON object of keyword arguments ({e}).") from None
    if not isinstance(tune, dict):
        raise SystemExit(f"the second argument must be a JSON object, got {argv[1]!r}.")
    why = unknown_switches(tune, fixed=("factored",))  # the first argument sets ``factored``
    if why:
        raise SystemExit(why)
    if not torch.cuda.is_available():
        raise SystemExit("this profiles a GPU kernel and there is no CUDA device here.")
    b, hq, hkv, d, n = 8, 32, 8, 128, 32768
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dt)
    k_new, v_new = (torch.randn(b, hkv, 1, d, device=dev, dtype=dt) for _ in range(2))
    kq, vq = (quantize(torch.randn(b, hkv, n, d, device=dev, dtype=dt), 4, 32) for _ in range(2))
    run = Run(4, 32, kq, vq, n)
    for _ in range(3):
        decode_attention_triton(q, [run], k_new, v_new, None, d ** -0.5, factored=path == "factored", **tune)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
