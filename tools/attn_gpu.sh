#!/usr/bin/env bash
# GPU check of the FP8 cache and the sparse attention kernel in one device call: the gpu-marked attention
# kernel tests, `ds4 bench attention` (Flash shapes, FP8 cache, against the measured roofline), the model on
# CUDA with the FP8 cache against the CPU reference, the decode graph against eager, then a sweep of launch
# plans if time is left. Run from the repo root; logs and JSON go to $OUT (default .out/). Needs the wheels of
# tools/fetch_device_wheels.sh in .whl/ (the engine imports xgrammar).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. tools/install_device_wheels.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sparse_attention_gpu.py > "$OUT/kernel_tests.log" 2>&1
kernel=$?
timeout 35 python3 -m ds4.cli bench attention --json "$OUT/attention.json" > "$OUT/bench.log" 2>&1
bench=$?
timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_model_gpu.py > "$OUT/model_tests.log" 2>&1
model=$?
timeout 25 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_gpu.py \
  -k "decode_path_never_syncs or greedy_under_continuous" > "$OUT/engine_tests.log" 2>&1
engine=$?
timeout 15 python3 -m ds4.cli bench attention --sweep --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
for f in kernel_tests model_tests engine_tests; do echo "== $f"; tail -n 15 "$OUT/$f.log"; done
echo "== sweep"; grep "^sweep" "$OUT/sweep.log" | tail -n 12
echo "== bench"; cat "$OUT/bench.log" | tail -n 25
cat "$OUT/gpu.txt"
echo "rc: kernel tests $kernel, bench $bench, model tests $model, engine tests $engine"
exit $(( kernel || bench || model || engine ))
