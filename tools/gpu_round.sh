#!/usr/bin/env bash
# One device call for a top-k tuning round: the gpu-marked top-k and engine tests, the top-k sweep
# (`ds4 bench kernels --skip-indexer --all-tiles`), then per-step traces. Extra arguments are trace knob sets,
# each a quoted "knob=value ..." string. Run from the repo root with `carry: [".whl"]`; output goes to $OUT.
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4_CACHE=/tmp/ds4-cache
. tools/install_device_wheels.sh
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gpu_kernels.py -k "not indexer" \
  tests/engine/test_engine_gpu.py 2>&1 | tail -n 15
timeout 340 python3 -c "import sys; from ds4.bench.kernels import main; sys.exit(main(sys.argv[1:]))" \
  --skip-indexer --all-tiles --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
sed -n '/top-k rows x cols/,$p' "$OUT/bench.log" | grep -v '^compiled' | cut -c1-200
grep '^compiled' "$OUT/bench.log" | cut -c1-160
for knobs in "$@"; do timeout 50 python3 tools/topk_trace.py $knobs 2>&1 | tail -n 40; done

