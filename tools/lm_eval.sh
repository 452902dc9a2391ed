#!/usr/bin/env bash
# `make eval`: start `ds4 serve`, run lm-eval's two task kinds of eval/ds4_check against it, stop the server.
#   ds4_check_mc  (multiple choice: loglikelihood via echo + logprobs)  with model local-completions
#   ds4_check_gen (generate until a stop string)                         with model local-chat-completions
# Environment: DS4 (the ds4 command), LM_EVAL (lm-eval's command), EVAL_LIMIT (examples per task; empty: all),
# DS4_SERVE_ARGS (extra `ds4 serve` flags, e.g. --model DIR), EVAL_PORT, EVAL_OUT (logs and results).
set -euo pipefail
cd "$(dirname "$0")/.."
DS4=${DS4:-.venv/bin/ds4}
LM_EVAL=${LM_EVAL:-.venv-eval/bin/lm_eval}
PORT=${EVAL_PORT:-8017}
OUT=${EVAL_OUT:-eval-results}
NAME=ds4-eval
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
healthy() { python3 -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; }

# shellcheck disable=SC2086  # DS4 and DS4_SERVE_ARGS may hold several words
$DS4 serve --port "$PORT" --served-model-name "$NAME" ${DS4_SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  if healthy; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then cat "$OUT/serve.log"; exit 1; fi
  sleep 0.5
done
healthy

# The tasks' data are local files: nothing may come from a hub.
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
limit=()
if [[ -n "${EVAL_LIMIT:-}" ]]; then limit=(--limit "$EVAL_LIMIT"); fi
common=(--include_path eval "${limit[@]}")
# tokenizer_backend=remote: lm-eval counts context tokens with the server's /tokenize (no tokenizer download).
"$LM_EVAL" run --model local-completions --tasks ds4_check_mc "${common[@]}" --output_path "$OUT/mc" \
  --model_args "model=$NAME,base_url=$URL/v1/completions,tokenizer_backend=remote,max_retries=1"
"$LM_EVAL" run --model local-chat-completions --apply_chat_template --tasks ds4_check_gen "${common[@]}" \
  --output_path "$OUT/gen" --model_args "model=$NAME,base_url=$URL/v1/chat/completions,max_retries=1"
