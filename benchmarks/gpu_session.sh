#!/usr/bin/env bash
# The one prepared run for a lent GPU, under 9.5 minutes: the Triton kernel's whole-cache tests, the
# store path's programs and the Triton ops of a traced step on the GPU, then benchmarks/gpu_generate.py's default (Qwen2.5-1.5B's shape, bf16, random weights; the
# stock DynamicCache in eager mode, the compiled StaticCache, and memory=0.2, at 8K and 32K, batch 8;
# the largest batch in 12 GiB). Its JSON and logs go to $OUT (the device tool's folder), else results/.
#
# The lent machine has torch, triton and an older transformers, and no registry. Carry the wheels
# kvevict needs beside them, made here first:
#     pip download --no-deps -d .gpu-wheels "transformers==5.24.0"   # its other needs are there
# then, with the device tool: run(carry=[".gpu-wheels"], command="bash benchmarks/gpu_session.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/src:$PWD"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/versions.txt"
(cd tests && TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -x test_kernel_triton.py -k gpu_generates) 2>&1 | tail -5 | tee "$out/kernel_tests.txt"
# the store path's programs (rotation, quantized write), held to the reference bit for bit, compiled
(cd tests && TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -x test_store_triton.py) 2>&1 | tail -5 | tee -a "$out/kernel_tests.txt"
# the Triton launches as custom ops in a traced step: fake shapes, traced = eager, a captured step on the triton backend
(cd tests && TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -x test_triton_ops.py) 2>&1 | tail -5 | tee -a "$out/kernel_tests.txt"
# what is left of 9.5 minutes (the device tool's limit is 10 a call); the JSON is written as each shape finishes
left=$((570 - SECONDS))  # timeout 0 would mean no limit: at least a minute
timeout $((left > 60 ? left : 60)) python3 benchmarks/gpu_generate.py --out "$out/gpu_generate.json" > "$out/gpu_generate.log" 2>&1
echo "gpu_generate exit $?" | tee -a "$out/gpu_generate.log"
tail -25 "$out/gpu_generate.log"
