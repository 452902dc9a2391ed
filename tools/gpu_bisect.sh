#!/usr/bin/env bash
# On the GPU machine: the first of the carried trees (.bisect/trees.tar.xz, tools/bisect_trees.sh) where the test
# NODEID fails, by bisection: the oldest tree is taken as good, the newest as bad (the test failed there). Each
# step runs the test alone from its tree (PER_STEP_S seconds at most, default 150), with the wheels
# tools/install_device_wheels.sh installed.
set -uo pipefail
cd "$(dirname "$0")/.."
node=${1:?usage: $0 NODEID}
trees=/tmp/ds4-bisect
[ -d "$trees/trees" ] || { mkdir -p "$trees" && tar -xJf .bisect/trees.tar.xz -C "$trees"; }
mapfile -t names < <(ls "$trees/trees")
lo=0
hi=$((${#names[@]} - 1))
echo "bisecting $node over ${#names[@]} trees"
while [ $((hi - lo)) -gt 1 ]; do
  mid=$(((lo + hi) / 2))
  tree=$trees/trees/${names[$mid]}
  (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout "${PER_STEP_S:-150}" \
    python3 -m pytest -q -x -p no:cacheprovider -m gpu "$node" > "$trees/step.txt" 2>&1)
  rc=$?
  echo "${names[$mid]}: rc $rc, $(tail -n 1 "$trees/step.txt")"
  if [ $rc -eq 0 ]; then lo=$mid; else hi=$mid; fi
done
echo "first bad: ${names[$hi]} (last good: ${names[$lo]})"
