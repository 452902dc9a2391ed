#!/usr/bin/env bash
# Here, before a GPU call: the trees (ds4/, tests/, pyproject.toml) of each REF (a commit or branch: the variants to time
# against each other), packed into .ab/trees.tar.xz, one folder a REF named by its position, the REF and its short
# hash. Carry `.ab`; on the GPU machine tools/gpu_measure.sh's stage `ab` (tools/gpu_ab.sh) times the same decode
# steps from each tree in turns on the one machine, so that the variants' differences are not the machines'.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 REF [REF...]"; exit 2; }
pairs=()
i=0
for ref in "$@"; do
  pairs+=("$i-$(echo "$ref" | tr -c 'A-Za-z0-9._\n-' '_')-$(git rev-parse --short "$ref")=$ref")
  i=$((i + 1))
done
bash tools/pack_trees.sh .ab/trees.tar.xz "${pairs[@]}"
echo "$i trees in .ab/trees.tar.xz ($(du -h .ab/trees.tar.xz | cut -f1)): $(tar -tJf .ab/trees.tar.xz | awk -F/ 'NF == 3 && $3 == "" {print $2}' | tr '\n' ' ')"
