#!/usr/bin/env bash
# The session's GPU check on the lent H200, in one call: the gpu-marked tests (pytest arguments narrow them),
# then the engine throughput benchmark on the built-in tiny model. Logs and JSON go to $OUT (default .out/).
# Needs the wheels from tools/fetch_device_wheels.sh carried in .whl/ (`carry: [".whl"]`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4_CACHE=/tmp/ds4-cache
. tools/install_device_wheels.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
# A cold machine compiles every Triton kernel first (64 of the gpu tests took 330 s in one process): with
# pytest-xdist carried (.whl), WORKERS processes (default 4) share the GPU and compile in parallel.
par=()
python3 -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-4}" --dist loadfile)
timeout "${TESTS_S:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "${par[@]}" tests/engine tests/model \
  tests/kernels "$@" 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 100 python3 -m ds4.cli bench throughput --num-prompts 200 --input-len 128 --output-len 64 \
  --max-num-seqs 64 --max-model-len 4096 --json "$OUT/bench_throughput.json" 2>&1 | tail -n 30 | tee "$OUT/bench_throughput.log"
bench=${PIPESTATUS[0]}
echo "gpu tests rc=$tests bench rc=$bench"
exit $(( tests || bench ))
