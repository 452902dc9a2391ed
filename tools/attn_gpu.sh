#!/usr/bin/env bash
# GPU check of the sparse attention kernel in one device call: its gpu-marked tests, `ds4 bench attention`
# (Flash shapes, FP8 cache, against the measured roofline), then (SWEEP=1, the default) `... --sweep`: key
# splits of small decode batches and candidate launch plans. BEFORE=DIR: also the table of the code in DIR (a
# folder holding another tree's ds4/ package, e.g. from `git archive`), same machine. Run from the repo root;
# logs and JSON go to $OUT (default .out/). Needs no wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${OUT:-.out}" && cd "${OUT:-.out}" && pwd)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
timeout "${TESTS_S:-80}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sparse_attention_gpu.py \
  > "$OUT/kernel_tests.log" 2>&1
tests=$?
timeout "${BENCH_S:-60}" python3 -m ds4.cli bench attention --json "$OUT/attention.json" > "$OUT/bench.log" 2>&1
bench=$?
if [ "${SWEEP:-1}" = 1 ]; then
  timeout "${SWEEP_S:-70}" python3 -m ds4.cli bench attention --sweep --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
fi
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && PYTHONPATH="$PWD" timeout "${BEFORE_S:-50}" python3 -m ds4.cli bench attention \
    --json "$OUT/before.json" > "$OUT/before.log" 2>&1)
fi
echo "== kernel tests"; tail -n 8 "$OUT/kernel_tests.log"
[ -f "$OUT/sweep.log" ] && { echo "== sweep"; grep "^sweep" "$OUT/sweep.log"; }
[ -f "$OUT/before.log" ] && { echo "== before"; tail -n 16 "$OUT/before.log"; }
echo "== bench"; tail -n 16 "$OUT/bench.log"
cat "$OUT/gpu.txt"
echo "rc: kernel tests $tests, bench $bench"
exit $(( tests || bench ))
