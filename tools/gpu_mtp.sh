#!/usr/bin/env bash
# Issue 20 on one GPU (run from the repo root; needs the server wheels: . tools/install_device_wheels.sh first):
#  1. the speculative CPU tests plus the GPU tests, on the device;
#  2. a server without MTP and with MTP k = 1, 2, 3, each measured with `ds4 bench serve` at concurrency 1/4/8
#     (--acceptance-lengths 1.5,2,2.5: random weights accept ~nothing, so every streamed chunk is one verify
#     step and the table also gives the tok/s those acceptance lengths would give at the measured step time).
# MODEL_ARGS picks the model (default: the built-in tiny one), e.g. MODEL_ARGS="--config flash --load-format dummy"
# for the Flash-shaped model with dummy weights (these weights are still held dequantised: the whole model fits
# one H200 only once checkpoint-precision weights land; `ds4 serve` has no layer cut, `ds4 bench model --layers`).
# Logs and JSON go to ${OUT:-out}/mtp; the last lines printed are the tables.
set -euo pipefail
out="${OUT:-out}/mtp"
mkdir -p "$out"
model_args=(${MODEL_ARGS:-})
serve_flags=(--max-num-seqs 16 --max-model-len ${MAX_MODEL_LEN:-16384} ${SERVE_FLAGS:-})
bench=(--concurrency 1,4,8 --trials ${TRIALS:-3} --input-len ${INPUT_LEN:-1024} --output-len ${OUTPUT_LEN:-256}
       --acceptance-lengths 1.5,2,2.5)

python -m pytest -q tests/engine/test_speculative.py tests/engine/test_speculative_verify.py \
  tests/model/test_rejected_tokens.py tests/serve/test_server_speculative.py >"$out/tests.log" 2>&1 \
  || { tail -30 "$out/tests.log"; exit 1; }

port=8765
for k in 0 1 2 3; do
  spec=()
  [ "$k" -gt 0 ] && spec=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
  python -m ds4.cli serve "${model_args[@]}" --port $port --served-model-name bench "${serve_flags[@]}" "${spec[@]}" \
    >"$out/serve_k$k.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  python -m ds4.cli bench serve --base-url "http://127.0.0.1:$port" --model bench "${bench[@]}" \
    --json "$out/serve_k$k.json" >"$out/bench_k$k.txt" 2>&1 || true
  curl -s "http://127.0.0.1:$port/metrics" | grep '^ds4_spec_decode' >"$out/metrics_k$k.txt" || true
  kill "$server"; wait "$server" || true
done
for k in 0 1 2 3; do echo "== k=$k"; cat "$out/bench_k$k.txt"; cat "$out/metrics_k$k.txt" 2>/dev/null; done
python -m ds4.cli bench prefill "${model_args[@]}" --lengths ${PREFILL_LENGTHS:-8k,32k,128k} --profile \
  --json "$out/prefill.json" >"$out/prefill.txt" 2>&1 || true
echo "== prefill"; tail -8 "$out/prefill.txt"
