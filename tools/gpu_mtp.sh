#!/usr/bin/env bash
# MTP speculative decoding on one GPU (run from the repo root, after `. tools/install_device_wheels.sh` with .whl carried: the engine
# imports xgrammar, the server fastapi). Stages, each logged under ${OUT:-out}/mtp, tables printed last:
#  tests  the speculative CPU tests and the GPU ones: graph replay == eager for verify and MTP draft steps
#         (k = 1, 2, 3), greedy with MTP and graphs == greedy without (tests/engine/test_speculative_gpu.py);
#  bench  `ds4 bench mtp` on the Flash-shaped dummy model cut to $LAYERS layers: the speculative step time per
#         k (0 = plain decode, 1, 2, 3) at batch 1 and 8, the tok/s it gives at acceptance lengths 1.5, 2 and
#         2.5, extrapolated per layer to 43 layers, next to the published figures;
#  serve  `ds4 serve` on the same model without MTP and with k = 1, 2, 3, each measured by `ds4 bench serve` at
#         concurrency 1/4/8 (short input and output); random weights accept ~nothing, so every streamed token is a
#         verify step and --acceptance-lengths gives the tok/s those acceptance lengths would give.
# (`ds4 bench prefill --profile` is in tools/gpu_serve.sh.)
# STAGES picks them (default "tests bench serve"); LAYERS (20), KS (0,1,2,3), CONTEXT (1024), STEPS (10) and
# the serve sizes below can be set from the environment; MODEL_ARGS replaces the model flags altogether.
set -uo pipefail
out="${OUT:-out}/mtp"
mkdir -p "$out"
stages=" ${STAGES:-tests bench serve} "
layers=${LAYERS:-20}
read -ra model <<<"${MODEL_ARGS:---config flash --load-format dummy --layers $layers}"
summary=()

if [[ $stages == *" tests "* ]]; then
  timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_speculative_gpu.py \
    tests/engine/test_engine_gpu.py tests/engine/test_padded_verify.py tests/model/test_verify_path.py tests/engine/test_speculative.py \
    tests/model/test_rejected_tokens.py >"$out/tests.log" 2>&1
  summary+=("tests (rc $?): $(tail -1 "$out/tests.log")")
fi

if [[ $stages == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-900}" python3 -m ds4.cli bench mtp "${model[@]}" --ks "${KS:-0,1,2,3}" \
    --batch-sizes "${BATCH_SIZES:-1,8}" --context "${CONTEXT:-1024}" --steps "${STEPS:-10}" \
    --acceptance-lengths 1.5,2,2.5 --json "$out/bench_mtp.json" >"$out/bench_mtp.txt" 2>"$out/bench_mtp.log"
  summary+=("bench mtp (rc $?)")
fi

if [[ $stages == *" serve "* ]]; then
  port=8765
  serve_flags=(--max-num-seqs 8 --max-model-len "${MAX_MODEL_LEN:-2048}" --no-enable-prefix-caching)
  bench=(--concurrency 1,4,8 --trials "${TRIALS:-2}" --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}"
         --acceptance-lengths 1.5,2,2.5)
  for k in ${SERVE_KS:-0 1 2 3}; do
    spec=()
    [ "$k" -gt 0 ] && spec=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
    python3 -m ds4.cli serve "${model[@]}" --port $port --served-model-name bench "${serve_flags[@]}" "${spec[@]}" \
      >"$out/serve_k$k.log" 2>&1 &
    server=$!
    for _ in $(seq 900); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
        2>/dev/null && break
      kill -0 "$server" 2>/dev/null || break
      sleep 1
    done
    timeout "${SERVE_BENCH_TIMEOUT:-600}" python3 -m ds4.cli bench serve --base-url "http://127.0.0.1:$port" \
      --model bench "${bench[@]}" --json "$out/serve_k$k.json" >"$out/bench_serve_k$k.txt" 2>&1
    summary+=("bench serve k=$k (rc $?)")
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
      | grep '^ds4_spec_decode' >"$out/metrics_k$k.txt"
    kill "$server"
    wait "$server"
  done
fi

for k in ${SERVE_KS:-0 1 2 3}; do
  [ -f "$out/bench_serve_k$k.txt" ] || continue
  echo "== ds4 bench serve, k=$k"; grep -v "^wrote" "$out/bench_serve_k$k.txt" | tail -12
  grep -E "mean_acceptance|num_drafts_total" "$out/metrics_k$k.txt"
done
[ -f "$out/bench_mtp.txt" ] && { echo "== ds4 bench mtp"; cat "$out/bench_mtp.txt"; }
[ -f "$out/bench_mtp.log" ] && [ ! -s "$out/bench_mtp.txt" ] && tail -20 "$out/bench_mtp.log"
[ -f "$out/tests.log" ] && grep -E "FAILED|ERROR|Error" "$out/tests.log" | head -20
printf '%s\n' "${summary[@]}"
