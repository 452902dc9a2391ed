#!/usr/bin/env bash
# One GPU call: Nsight Compute on the sparse attention kernel's 8K CSA prefill at Flash shapes, once a plan (the
# chosen one, then `ds4 bench attention`'s 64-head sweep candidates, in the order its log prints them:
# `ds4 bench attention --nsight`), SET (ncu section set, default full). Writes to $OUT: ncu_attention.ncu-rep,
# ncu_attention_raw.csv and ncu_attention.txt (a line a launch, tools/ncu_summary.py: duration, DRAM, issue slots,
# shared-memory and tensor pipes, registers, occupancy, the largest stall reasons). Needs the wheels in .whl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
. tools/install_device_wheels.sh > /dev/null 2>&1
ncu --profile-from-start off --set "${SET:-full}" -k "regex:^_sparse_attention_kernel$" -f -o "$OUT/ncu_attention" \
  python3 -m ds4.cli bench attention --nsight --json "$OUT/ncu_attention.json" > "$OUT/ncu_attention.log" 2>&1
echo "ncu rc=$? (log: ncu_attention.log)"
grep "nsight launch" "$OUT/ncu_attention.log"
ncu --import "$OUT/ncu_attention.ncu-rep" --csv --page raw > "$OUT/ncu_attention_raw.csv"
python3 tools/ncu_summary.py "$OUT/ncu_attention_raw.csv" > "$OUT/ncu_attention.txt"
cat "$OUT/ncu_attention.txt"
