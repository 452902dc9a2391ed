#!/usr/bin/env bash
# The measurements the open issues ask of one H200, in order of need, for tools/gpu_detached.sh (it sets RESULTS):
#   bash tools/gpu_detached.sh start tools/gpu_measure.sh     then, in the next call, `collect`
# Stages in the order STAGES names them (default: model4 tests model20 model20_serial engine engine_sync attention moe
# linear mhc): model4 (4 Flash layers with transformers beside them), tests (every gpu-marked test, several processes
# with pytest-xdist), model20 (20 Flash layers, prefill to 64K), model20_serial (its decode without the side-stream
# overlaps, `--serial`), model20_nopdl (without programmatic dependent launch, `--no-pdl`), engine and engine_sync
# (the engine's host time per step, async decode on and off, each with its costliest host functions), attention (with
# its plan sweep), moe (with its tile sweep; moe_skew: the 8K prefill's under a skewed routing like the dummy model's;
# moe_decode: decode batches alone, with their tile sweep), linear (the FP8 linear with its tile sweep), fp8_mma
# (tools/fp8_mma_gemv_probe.py: the M = 1 linear by an e4m3 MMA against the FMA kernel), mhc (the mHC kernels with the
# prefill projection's and the fused decode launch's sweeps), ncu (tools/ncu_decode.sh's Nsight Compute lines for the
# decode step's largest kernels, NCU_LAYERS layers), ncu_attention (tools/ncu_attention.sh on the 8K CSA prefill's
# attention plans), ab (tools/gpu_ab.sh: the decode steps of the trees tools/ab_trees.sh packed, in turns; carry
# `.ab`; AB_TESTS: the variants' gpu tests of those paths first), ab_engine (the same with `ds4 bench engine`: the
# engine's time a step). Each writes its log and JSON under $RESULTS and a line to $RESULTS/summary.txt; a stage that
# fails or runs out of its time does not stop the others. With the trees of tools/bisect_trees.sh carried (.bisect),
# the first failing test of each of up to 3 test files is bisected after the tests stage (tools/gpu_bisect.sh;
# LIMIT_bisect seconds each). TESTS names the test paths (default: all of tests/); COMPARE= (empty) leaves
# transformers out of model4; LAYERS the model stages' layers (default 20); LIMIT_<stage>=S sets a stage's time limit
# in seconds.
# Needs the wheels in .whl (tools/fetch_device_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${RESULTS:-/tmp/detached}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 DS4_CACHE=/tmp/ds4-cache PYTHONFAULTHANDLER=1  # a stage out of time dumps its stacks
ls .whl/*.whl > /dev/null 2>&1 || echo "no wheels in .whl (carry it): tests needing xgrammar, uvicorn or the tokenizer fail" >> "$R/summary.txt"
. tools/install_device_wheels.sh > /dev/null 2>&1
stage() {  # name timeout command... (LIMIT_<name> overrides the timeout)
  local name=$1 limit=$2 override="LIMIT_$1"
  limit=${!override:-$limit}
  shift 2
  local start=$SECONDS
  timeout -s ABRT -k 10 "$limit" "$@" > "$R/$name.txt" 2>&1
  echo "$name rc=$? ${SECONDS}s (took $((SECONDS - start)) s)" >> "$R/summary.txt"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$R/gpu.txt" 2>&1
par=()
python3 -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-4}" --dist loadfile)
model=(python3 -m ds4.cli bench model --config flash --load-format dummy --context 2048)
# A card of less than 100 GiB (an H100) holds 20 Flash layers (73.7 GB of weights) when the engine may take 93% of
# it and the allocator grows its segments (the 64K prefill's scratch fits then: H100, e527284, peak 79.6 GB), but
# not transformers' bf16 copy of 4: there model4 runs without transformers.
small=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | awk '{print ($1 < 100000)}')
if [ "${small:-0}" = 1 ]; then
  model+=(--gpu-memory-utilization 0.93)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  COMPARE=${COMPARE-}
fi
bisect_failures() {  # with the trees of tools/bisect_trees.sh: the first failing test of up to 3 files
  [ -f .bisect/trees.tar.xz ] || return 0
  grep -E "^(FAILED|ERROR) " "$R/tests.txt" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' | awk -F'::' '!seen[$1]++' \
    | head -n 3 | while read -r node; do
      stage "bisect_$(basename "${node%%::*}" .py)" "${LIMIT_bisect:-420}" bash tools/gpu_bisect.sh "$node"
    done
}
run_stage() {
  case $1 in
    model4) stage model4 600 "${model[@]}" --layers 4 --batch-sizes 1,64 --prefill-lengths 8192 ${COMPARE---compare-transformers} --json "$R/model4.json" ;;
    # pyproject's addopts has -q already: a second would hide the summary line (N passed)
    tests) stage tests 900 python3 -m pytest -m gpu -p no:cacheprovider -rf --durations=20 "${par[@]}" ${TESTS:-tests}
      bisect_failures ;;
    model20) stage model20 600 "${model[@]}" --layers "${LAYERS:-20}" --prefill-lengths 8192,65536 --batch-sizes 1,8,32,64 --json "$R/model20.json" ;;
    model20_nopdl) stage model20_nopdl 400 "${model[@]}" --layers "${LAYERS:-20}" --prefill-lengths 8192 --batch-sizes 1,64 --no-pdl --json "$R/model20_nopdl.json" ;;
    model20_serial) stage model20_serial 400 "${model[@]}" --layers "${LAYERS:-20}" --prefill-lengths 8192 --batch-sizes 1,64 --serial --json "$R/model20_serial.json" ;;
    engine) stage engine 400 python3 -m ds4.cli bench engine --batch-sizes 1,64 --input-len 128 --steps 50 --cprofile 30 --api-profile 30 --json "$R/engine.json" ;;
    engine_sync) stage engine_sync 200 python3 -m ds4.cli bench engine --batch-sizes 1,64 --input-len 128 --steps 50 --cprofile 30 --no-async-decode --json "$R/engine_sync.json" ;;
    attention) stage attention 420 python3 -m ds4.cli bench attention --sweep --json "$R/attention.json" ;;
    moe) stage moe 420 python3 -m ds4.cli bench moe --sweep --json "$R/moe.json" ;;
    moe_decode) stage moe_decode 240 python3 -m ds4.cli bench moe --tokens 1 8 64 --sweep 1 64 --json "$R/moe_decode.json" ;;
    moe_skew) stage moe_skew 240 python3 -m ds4.cli bench moe --skew 0.4 --tokens 8192 --sweep 8192 --json "$R/moe_skew.json" ;;
    fp8_mma) stage fp8_mma 200 python3 tools/fp8_mma_gemv_probe.py ;;
    linear) stage linear 300 python3 -m ds4.cli bench linear --sweep --json "$R/linear.json" ;;  # then tools/gemv_pick.py on it
    mhc) stage mhc 240 python3 -m ds4.cli bench kernels --only mhc --all-tiles --json "$R/mhc.json" ;;
    ncu) stage ncu 300 env OUT="$R/ncu" LAYERS="${NCU_LAYERS:-4}" bash tools/ncu_decode.sh ;;
    ncu_attention) stage ncu_attention 300 env OUT="$R/ncu_attention" bash tools/ncu_attention.sh ;;
    ab) stage ab 900 env OUT="$R/ab" bash tools/gpu_ab.sh ;;
    ab_engine) stage ab_engine 600 env OUT="$R/ab_engine" BENCH=engine bash tools/gpu_ab.sh ;;
    *) echo "unknown stage $1" >> "$R/summary.txt" ;;
  esac
}
for name in ${STAGES:-model4 tests model20 model20_serial engine engine_sync attention moe linear mhc}; do
  run_stage "$name"
done
cat "$R/summary.txt"
