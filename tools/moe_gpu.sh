#!/usr/bin/env bash
# GPU check of the fused MoE in one device call: `ds4 bench moe` (its arguments, e.g. --tokens 1 8 64 8192
# --sweep 1 64), the fused-MoE GPU tests, with MODEL_S set the model GPU tests (MODEL_TESTS), then BEFORE=DIR:
# the bench table of the code in DIR (a folder holding another tree's ds4/ package, e.g. the main checkout), same
# machine, BEFORE_ARGS its arguments. Run from the repo root; logs and JSON go to $OUT (default .out/); the last
# lines printed are the tables. Needs no wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${OUT:-.out}" && cd "${OUT:-.out}" && pwd)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
timeout "${BENCH_S:-100}" python3 -m ds4.cli bench moe --json "$OUT/bench_moe.json" "$@" > "$OUT/bench.log" 2>&1
bench=$?
timeout "${TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider --maxfail=6 -m gpu tests/kernels/test_moe_gpu.py \
  --durations=5 > "$OUT/moe_tests.log" 2>&1
tests=$?
model=0
if [ "${MODEL_S:-0}" != 0 ]; then
  # shellcheck disable=SC2086
  timeout "$MODEL_S" python3 -m pytest -q -p no:cacheprovider --maxfail=4 -m gpu ${MODEL_TESTS:-tests/model/test_model_gpu.py} \
    > "$OUT/model_tests.log" 2>&1
  model=$?
fi
if [ -n "${BEFORE:-}" ]; then
  # shellcheck disable=SC2086
  (cd "$BEFORE" && PYTHONPATH="$PWD" timeout "${BEFORE_S:-45}" python3 -m ds4.cli bench moe ${BEFORE_ARGS:-} \
    --json "$OUT/before.json" > "$OUT/before.log" 2>&1)
fi
echo "== moe tests"; tail -n 12 "$OUT/moe_tests.log" | cut -c1-300
[ -f "$OUT/model_tests.log" ] && { echo "== model tests"; tail -n 6 "$OUT/model_tests.log" | cut -c1-300; }
[ -f "$OUT/before.log" ] && { echo "== before"; grep -v "^tokens [0-9]*: {" "$OUT/before.log" | tail -n 10 | cut -c1-300; }
echo "== bench"; grep -v "^tokens [0-9]*: {" "$OUT/bench.log" | tail -n 26 | cut -c1-300
cat "$OUT/gpu.txt"
echo "rc: bench $bench, moe tests $tests, model tests $model"
exit $(( tests || bench || model ))
