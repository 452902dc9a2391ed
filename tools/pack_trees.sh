#!/usr/bin/env bash
# Packs the trees (ds4/, tests/, pyproject.toml) of commits into one xz archive, a folder trees/NAME each:
#   bash tools/pack_trees.sh ARCHIVE NAME=COMMIT [NAME=COMMIT...]
# (tools/ab_trees.sh and tools/bisect_trees.sh; xz finds the trees' repeats, so many trees take a few hundred KB).
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:?usage: $0 ARCHIVE NAME=COMMIT...}
shift
work=$(mktemp -d)
mkdir -p "$work/trees" "$(dirname "$archive")"
for pair in "$@"; do
  mkdir -p "$work/trees/${pair%%=*}"
  git archive "${pair#*=}" ds4 tests pyproject.toml | tar -x -C "$work/trees/${pair%%=*}"
done
XZ_OPT="-9e" tar -C "$work" -cJf "$archive" trees
rm -rf "$work"
