#!/usr/bin/env bash
# One GPU run for the FP8 linear (issue 17): compile the sweep's plans in parallel, time them, write the fastest
# tile settings into fp8_linear.py (tools/gemv_pick.py), then the GPU tests and `ds4 bench linear` on what was
# picked. Logs and JSON under $OUT; the table last.
set -u
OUT=${OUT:-/tmp/gemv_out}
mkdir -p "$OUT"
SHAPES="wq_a wq_b wkv wo_a wo_b"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
warm() {  # compile (run once) the sweep plans of family $1, shape $2
    python3 -c "from ds4.bench.linear import sweep; sweep('$1', ['$2'], rep=0)" >>"$OUT/warm.log" 2>&1
}
for fam in fma_m1 dot_m1 dot_m4 dot_m16 dot_m64; do
    for s in $SHAPES; do warm $fam $s & done
    wait
done
echo "warm $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m ds4.cli bench linear --shapes $SHAPES --m --sweep --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"; tail -15 "$OUT/sweep.log"
python3 tools/gemv_pick.py "$OUT/sweep.json" | tee "$OUT/pick.txt"
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear_gpu.py -k decode_shapes >"$OUT/test1.log" 2>&1 &
p1=$!
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear_gpu.py -k "not decode_shapes" >"$OUT/test2.log" 2>&1 &
p2=$!
for s in wq_a wq_b wkv wo_a wo_b shared_w13 shared_w2 idx_wq_b 4096x4096; do
    python3 -c "
import torch
from ds4.bench.linear import SHAPES, _inputs
from ds4.kernels import fp8_linear as fl
n, k, g, q = SHAPES['$s']
for m in (1, 4, 16, 32, 64, 128):
    x, w, s = _inputs(n, k, g, m); fl.fp8_linear(x, w, s, g, q, impl='triton')
torch.cuda.synchronize()" >>"$OUT/warm.log" 2>&1 &
done
wait $p1; echo "tests decode_shapes rc=$?"; wait $p2; echo "tests other rc=$?"; wait
tail -3 "$OUT/test1.log"; tail -3 "$OUT/test2.log"
echo "tests $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m ds4.cli bench linear --m 1 4 16 32 64 128 --rep 100 --json "$OUT/linear.json" >"$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"
grep -v " done" "$OUT/bench.log"
