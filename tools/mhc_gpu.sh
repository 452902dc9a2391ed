#!/usr/bin/env bash
# GPU check of the mHC and RMSNorm kernels in one device call (about 1-2 minutes): their gpu-marked tests and the
# model's CUDA-against-CPU tests, then `ds4 bench kernels --only mhc` (ds4 against the torch reference, eager and
# graph-replayed, at T = 1, 64, 8192, next to the bytes roofline). With MHC_MODEL=1 also the 4-layer Flash
# `ds4 bench model` profile by kernel family (needs the .whl/ wheels carried: the engine imports xgrammar).
# Run from the repo root; logs and JSON go to $OUT (default .out/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_layer_kernels_gpu.py \
  tests/model/test_model_gpu.py 2>&1 | tee "$OUT/mhc_tests.log" | tail -15
tests=${PIPESTATUS[0]}
timeout 150 python3 -m ds4.cli bench kernels --only mhc --json "$OUT/mhc_kernels.json" > "$OUT/mhc_bench.log" 2>&1
bench=$?
model=0
if [ "${MHC_MODEL:-0}" = 1 ]; then
  . tools/install_device_wheels.sh
  timeout 300 python3 -m ds4.cli bench model --config flash --layers 4 --load-format dummy --context 2048 \
    --batch-sizes 1,64 --prefill-lengths 8192 --json "$OUT/mhc_model.json" > "$OUT/mhc_model.log" 2>&1
  model=$?
  tail -60 "$OUT/mhc_model.log"
fi
cat "$OUT/gpu.txt"
sed -n '/^mHC \/ norm/,$p' "$OUT/mhc_bench.log" | grep -v '^compiled'
grep -E "^compiled.*'(mhc|rms_norm|rope|gated_pool)" "$OUT/mhc_bench.log"
[ "$bench" = 0 ] || tail -20 "$OUT/mhc_bench.log"
echo "gpu tests rc=$tests bench rc=$bench model rc=$model"
exit $(( tests || bench || model ))
