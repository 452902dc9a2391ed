#!/usr/bin/env bash
# On the GPU machine: the decode steps of `ds4 bench model` (20 Flash layers, dummy weights, no profile), or with
# BENCH=engine those of `ds4 bench engine` (the built-in tiny model: the engine's own time a step), from each tree
# of .ab/trees.tar.xz (tools/ab_trees.sh), ROUNDS rounds of every tree in turn (default 2: a drift of the machine
# shows as a difference between rounds, not between trees), each run PER_RUN_S seconds at most (default 200), with
# the wheels tools/install_device_wheels.sh installed. Writes OUT/<tree>.<round>.json and prints the median ms/step
# of each tree and batch over its rounds. BATCHES (default 1,64), LAYERS (default 20). AB_TESTS (test paths, e.g.
# tests/engine): first the gpu-marked tests of those paths in every tree but the first (the variants), each's summary
# printed and its log in OUT/<tree>.tests.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?OUT: the folder for the results}
trees=/tmp/ds4-ab
[ -d "$trees/trees" ] || { mkdir -p "$trees" && tar -xJf .ab/trees.tar.xz -C "$trees"; }
mkdir -p "$out"
extra=()
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | awk '{print ($1 < 100000)}')" = 1 ]; then
  extra=(--gpu-memory-utilization 0.93)  # 20 layers on a card under 100 GiB (see tools/gpu_measure.sh)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
if [ -n "${AB_TESTS:-}" ]; then
  for tree in "$trees"/trees/*/; do
    name=$(basename "$tree")
    case $name in 0-*) continue ;; esac
    # shellcheck disable=SC2086  # AB_TESTS: several paths
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" DS4_CACHE="/tmp/ds4-cache-$name" timeout -s ABRT "${TESTS_S:-600}" \
      python3 -m pytest -m gpu -p no:cacheprovider -rf $AB_TESTS > "$out/$name.tests.txt" 2>&1)
    echo "$name tests: rc $? ($(tail -n 1 "$out/$name.tests.txt"))"
  done
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "$trees"/trees/*/; do
    name=$(basename "$tree")
    if [ "${BENCH:-model}" = engine ]; then
      bench=(bench engine --input-len 128 --steps 50)
    else
      bench=(bench model --config flash --load-format dummy --context 2048 --layers "${LAYERS:-20}" --prefill-lengths 8192
        --no-profile "${extra[@]}")
    fi
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" DS4_CACHE="/tmp/ds4-cache-$name" timeout -s ABRT "${PER_RUN_S:-200}" \
      python3 -m ds4.cli "${bench[@]}" --batch-sizes "${BATCHES:-1,64}" \
      --json "$out/$name.$round.json" > "$out/$name.$round.txt" 2>&1)
    echo "$name round $round: rc $?"
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    tree = path.name.rsplit(".", 2)[0]
    result = json.loads(path.read_text())
    for row in result["decode"] if "decode" in result else result["rows"]:  # bench model's, bench engine's
        ms = row["ms_per_step"] if "ms_per_step" in row else row["step_ms"]
        runs.setdefault(tree, {}).setdefault(row["batch"], []).append(ms)
for tree, batches in runs.items():
    cells = []
    for batch, ms in sorted(batches.items()):
        cells.append(f"batch {batch}: {statistics.median(ms):.3f} ms ({' '.join(f'{m:.3f}' for m in ms)})")
    print(f"{tree}: " + "; ".join(cells))
PY
