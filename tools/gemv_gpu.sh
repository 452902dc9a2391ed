#!/usr/bin/env bash
# One GPU run for the FP8 linear (issue 17): compile the sweep's plans in parallel processes, time them, write the
# fastest tile settings into fp8_linear.py's TILE_TABLE (tools/gemv_pick.py), then run the GPU tests and
# `ds4 bench linear` on what was picked. Logs and JSON under $OUT (7 files); the table last.
set -u
OUT=${OUT:-/tmp/gemv_out}
mkdir -p "$OUT"
SHAPES="wq_a wq_b wkv wo_a wo_b"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
for i in 0 1 2 3 4 5 6 7; do  # candidate i of every sweep family, run once at every shape: compiles it
    python3 -c "
import ds4.bench.linear as bl
for family, (m, use_dot, candidates) in list(bl.SWEEPS.items()):
    bl.SWEEPS[family] = (m, use_dot, candidates[$i:$i + 1])
    bl.sweep(family, '$SHAPES'.split(), rep=0)
" >>"$OUT/warm.log" 2>&1 &
done
wait
echo "warm $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m ds4.cli bench linear --shapes $SHAPES --m --sweep --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"
grep "^sweep [a-z0-9_]*:" "$OUT/sweep.log"; grep -c '"error"' "$OUT/sweep.json"
python3 tools/gemv_pick.py "$OUT/sweep.json"
grep -n -A4 "^TILE_TABLE" ds4/kernels/fp8_linear.py
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear_gpu.py -k decode_shapes >"$OUT/test1.log" 2>&1 &
p1=$!
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear_gpu.py -k "not decode_shapes" >"$OUT/test2.log" 2>&1 &
p2=$!
for s in wq_a wq_b wkv wo_a wo_b shared_w13 shared_w2 idx_wq_b 4096x4096; do  # compile the bench's plans
    python3 -c "
from ds4.bench.linear import SHAPES, _inputs
from ds4.kernels import fp8_linear as fl
n, k, g, q = SHAPES['$s']
for m in (1, 4, 16, 32, 64, 128):
    x, w, s = _inputs(n, k, g, m)
    fl.fp8_linear(x, w, s, g, q, impl='triton')
" >>"$OUT/warm.log" 2>&1 &
done
wait $p1; r1=$?; wait $p2; r2=$?; wait
echo "tests rc=$r1/$r2 $(( $(date +%s) - t0 )) s"
tail -4 "$OUT/test1.log"; tail -4 "$OUT/test2.log"
timeout 100 python3 -m ds4.cli bench linear --m 1 4 16 32 64 128 --rep 100 --json "$OUT/linear.json" >"$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"
grep -v " done$" "$OUT/bench.log"
