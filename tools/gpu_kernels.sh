#!/usr/bin/env bash
# GPU check of the kernels in one device call: `ds4 bench kernels` (extra arguments go to it, e.g.
# --all-tiles), then the gpu-marked kernel tests, then each quoted line of $TOPK_SWEEPS through
# tools/topk_sweep.py. Run from the repo root; logs and JSON go to $OUT (default .out/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
timeout 150 python3 -m ds4.cli bench kernels --json "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
while IFS= read -r sweep; do
  [ -n "$sweep" ] && eval "timeout 60 python3 tools/topk_sweep.py $sweep" 2>&1 | tee -a "$OUT/sweep.log"
done <<< "${TOPK_SWEEPS:-}"
cat "$OUT/gpu.txt"
echo "gpu tests rc=$tests bench rc=$bench"
exit $(( tests || bench ))
