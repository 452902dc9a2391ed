#!/usr/bin/env bash
# GPU check of the attention entries' kernels (norm_rope, pooled entries, ring writes) in one device call: their
# gpu-marked tests, the model's and the engine's (CUDA graphs), then the 4-layer Flash decode/prefill bench with its
# per-family profile. Run from the repo root; logs and JSON go to $OUT (default .out/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_layer_kernels_gpu.py \
  tests/model/test_model_gpu.py tests/engine/test_engine_gpu.py > "$OUT/gpu_tests.log" 2>&1
tests=$?
timeout 130 python3 -m ds4.cli bench model --config flash --layers 4 --load-format dummy --context 2048 \
  --batch-sizes 1,64 --prefill-lengths 8192 --decode-steps 10 --json "$OUT/bench_model.json" > "$OUT/bench_model.log" 2>&1
bench=$?
grep -v "it/s\]\|tok/s\]\|B/s\]" "$OUT/bench_model.log" | tail -42
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -15
cat "$OUT/gpu.txt"
echo "gpu tests rc=$tests bench rc=$bench"
