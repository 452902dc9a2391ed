#!/usr/bin/env bash
# The engine's own time per decode step on the GPU, in one device call, on the built-in tiny
# model: the gpu-marked engine tests, `ds4 bench engine` at 1 and 64 running requests (greedy with async decode
# on and off, then temperature 1 with the costliest host functions), and `ds4 bench model`'s tiny decode at 64.
# With BEFORE_TREE set to a copy of an older tree (no .git needed), that tree's own `ds4 bench engine` runs too,
# for a before/after on one machine. Logs and JSON go to $OUT (default .out/); tables print last.
# Needs the wheels from tools/fetch_device_wheels.sh carried in .whl/ (the engine imports xgrammar).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-.out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4_CACHE=/tmp/ds4-cache
. tools/install_device_wheels.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"

timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine 2>&1 | tail -n 15 > "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}

bench() {  # name, tree, extra args
  local name=$1 tree=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 150 python3 -m ds4.bench.engine --batch-sizes 1,64 --input-len 128 \
    --steps 50 --json "$OUT/engine_$name.json" "$@" >"$OUT/engine_$name.txt" 2>"$OUT/engine_$name.err")
  echo "bench engine $name rc=$?" >> "$OUT/rc.txt"
}
: > "$OUT/rc.txt"
bench greedy "$PWD"
bench greedy_no_async "$PWD" --no-async-decode
bench temperature1 "$PWD" --temperature 1 --cprofile 30
if [ -n "${BEFORE_TREE:-}" ]; then
  BEFORE_TREE=$(realpath "$BEFORE_TREE")
  bench before_greedy "$BEFORE_TREE"
  bench before_temperature1 "$BEFORE_TREE" --temperature 1 --cprofile 30
fi
timeout 180 python3 -m ds4.cli bench model --batch-sizes 1,64 --context 4096 --prefill-lengths 8192 \
  --decode-steps 20 --no-profile --json "$OUT/model_tiny.json" >"$OUT/model_tiny.txt" 2>"$OUT/model_tiny.err"
echo "bench model tiny rc=$?" >> "$OUT/rc.txt"

cat "$OUT/gpu.txt"
echo "== gpu tests (rc=$tests)"
tail -n 3 "$OUT/gpu_tests.log"
for f in "$OUT"/engine_*.txt; do
  echo "== $(basename "$f")"
  cat "$f"
done
echo "== host profile, temperature 1 (top of the cProfile listing)"
grep -A 40 "host-only steps" "$OUT/engine_temperature1.err" | head -n 45
echo "== bench model, tiny"
head -n 12 "$OUT/model_tiny.txt"
cat "$OUT/rc.txt"
