#!/usr/bin/env bash
# GPU smoke run of `ds4 bench model`: Flash shapes cut to 2 layers, dummy weights, short contexts, compared with
# transformers. Writes bench.json / bench.svg / logs under $OUT and prints the tables last.
# Needs the wheels from tools/fetch_device_wheels.sh carried in .whl/ (the engine imports xgrammar).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. tools/install_device_wheels.sh
timeout "${BENCH_TIMEOUT:-180}" python3 -m ds4.cli bench model --config flash --layers 2 --load-format dummy \
    --context 512 --batch-sizes 1,8,64 --prefill-lengths 2048,8192 --decode-steps 5 \
    --json "$OUT/bench.json" --plot "$OUT/bench.svg" --compare-transformers >"$OUT/bench.txt" 2>"$OUT/bench.err"
echo "rc=$?"
tr '\r' '\n' <"$OUT/bench.err" | grep -v '^\s*$' | tail -n 25
cat "$OUT/bench.txt"
