#!/usr/bin/env bash
# GPU check for the top-k and indexer kernels: gpu-marked tests, then the benchmark.
# Run on the lent H200 from the repo root; logs and JSON go to $OUT (default .out/). Under 5 minutes.
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
timeout 130 python3 -m pytest -q --maxfail=6 -m gpu tests/kernels/test_gpu_kernels.py "$@" 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 150 python3 -c "import sys; from ds4.bench.kernels import main; sys.exit(main(sys.argv[1:]))" \
  --json "$OUT/bench_kernels.json" --all-tiles 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests rc=$tests bench rc=$bench"
exit $(( tests || bench ))
