#!/usr/bin/env bash
# GPU check for the fused MoE: the routed-experts GPU tests, then `ds4 bench moe` (arguments go to the bench,
# e.g. --tokens 1 8 64 8192 --sweep), then (MODEL_S > 0) the model/engine GPU tests that run the op in the
# dequantized format. Logs go to $OUT; the last lines printed are the bench table and the sweep.
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
timeout "${TEST_S:-110}" python3 -m pytest -q --maxfail=4 -m gpu tests/kernels/test_moe_gpu.py --durations=6 \
  > "$OUT/moe_tests.log" 2>&1
tests=$?
tail -n 25 "$OUT/moe_tests.log"
timeout "${BENCH_S:-150}" python3 -m ds4.bench.moe --json "$OUT/bench_moe.json" "$@" > "$OUT/bench.log" 2>&1
bench=$?
tail -n 40 "$OUT/bench.log" | cut -c1-400
model=0
if [ "${MODEL_S:-0}" != 0 ]; then
  timeout "$MODEL_S" python3 -m pytest -q --maxfail=4 -m gpu ${MODEL_TESTS:-tests/model/test_model_gpu.py tests/engine/test_engine_gpu.py} \
    > "$OUT/model_tests.log" 2>&1
  model=$?
  tail -n 20 "$OUT/model_tests.log"
fi
echo "moe tests rc=$tests bench rc=$bench model tests rc=$model"
