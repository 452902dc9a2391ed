#!/usr/bin/env bash
# One GPU call: Nsight Compute on one eager decode step of the Flash-shaped dummy model (`ds4 bench model
# --nsight`: the step runs between cudaProfilerStart and Stop), for the kernels matching KERNELS (a regex; default
# the decode step's largest), LAYERS layers (default 4), batch BATCH (default 1), SET (ncu section set, default
# full). Writes to $OUT: ncu_decode.ncu-rep (open it in Nsight Compute), ncu_raw.csv (every metric, a row a
# kernel launch) and ncu_decode.txt (a line a launch: duration, DRAM and issue-slot use, registers, occupancy,
# the largest warp-stall reasons per issued instruction). Needs the wheels in .whl (tools/fetch_device_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
. tools/install_device_wheels.sh > /dev/null 2>&1
kernels=${KERNELS:-^(_fp8_gemv_kernel|_post_project_kernel|_sparse_attention_kernel|_grouped_gemm_kernel|_gemv_kernel|_combine_splits|_norm_rope_kernel|_pooled_entries_kernel)$}
ncu --profile-from-start off --set "${SET:-full}" -k "regex:$kernels" -f -o "$OUT/ncu_decode" \
  python3 -m ds4.cli bench model --config flash --load-format dummy --layers "${LAYERS:-4}" --context 2048 \
  --batch-sizes "${BATCH:-1}" --prefill-lengths 256 --decode-steps 2 --no-profile --nsight \
  > "$OUT/ncu_decode.log" 2>&1
echo "ncu rc=$? (log: ncu_decode.log)"
ncu --import "$OUT/ncu_decode.ncu-rep" --csv --page raw > "$OUT/ncu_raw.csv"
python3 tools/ncu_summary.py "$OUT/ncu_raw.csv" > "$OUT/ncu_decode.txt"
head -c 8000 "$OUT/ncu_decode.txt"
