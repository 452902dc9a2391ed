#!/usr/bin/env bash
# Here, before a GPU call: the trees (ds4/, tests/, pyproject.toml) of BASE (default: the last commit whose GPU
# tests passed, as you name it) and of every later commit that touched them, oldest first, packed into
# .bisect/trees.tar.xz (a few hundred KB: xz finds the trees' repeats). Carry `.bisect`; on the GPU machine
# tools/gpu_bisect.sh finds the first tree where a failing test fails (tools/gpu_measure.sh does it for the
# tests that fail in its tests stage).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: $0 BASE_COMMIT}
pairs=()
i=0
for c in $(git rev-parse --short "$base") $(git log --reverse --format=%h "$base..HEAD" -- ds4 tests pyproject.toml); do
  pairs+=("$(printf %03d $i)_$c=$c")
  i=$((i + 1))
done
bash tools/pack_trees.sh .bisect/trees.tar.xz "${pairs[@]}"
echo "$i trees in .bisect/trees.tar.xz ($(du -h .bisect/trees.tar.xz | cut -f1))"
