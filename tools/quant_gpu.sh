#!/usr/bin/env bash
# The quant GPU check in one call: FP8 linear and checkpoint-precision model tests, the engine's GPU tests (the
# tiny model now runs in checkpoint precision), `ds4 bench linear` at Flash shapes, and the GEMV probe.
# Logs and JSON go to $OUT (default .out/). Needs the wheels of tools/fetch_device_wheels.sh in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4_CACHE=/tmp/ds4-cache
. tools/install_device_wheels.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout 50 python3 -m pytest -v -rf -p no:cacheprovider tests/kernels/test_fp8_linear_gpu.py \
  tests/model/test_model_gpu.py "$@" 2>&1 | tee "$OUT/quant_tests.log" | grep -v PASSED | tail -n 25
tests=${PIPESTATUS[0]}
timeout 30 python3 -m pytest -q -rf -p no:cacheprovider tests/engine/test_engine_gpu.py 2>&1 \
  | tee "$OUT/engine_tests.log" | tail -n 15
engine=${PIPESTATUS[0]}
timeout 25 python3 -m ds4.cli bench linear --shapes 4096x4096 wq_b wo_a --m 1 8 16 64 8192 \
  --json "$OUT/bench_linear.json" 2>"$OUT/bench_linear.err" | tee "$OUT/bench_linear.log"
bench=${PIPESTATUS[0]}
timeout 12 python3 tools/fp8_gemv_probe.py 2>&1 | tee "$OUT/gemv_probe.log"
echo "quant tests rc=$tests bench rc=$bench engine tests rc=$engine"
