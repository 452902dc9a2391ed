#!/usr/bin/env bash
# Work longer than one device call (10 min): start a script detached on the lent GPU machine, then collect.
#   bash tools/gpu_detached.sh start SCRIPT [ARGS...]   copy the tree to /tmp/ds4run, run SCRIPT there under
#                                                       setsid (it survives the call), then collect
#   bash tools/gpu_detached.sh collect                  wait for it (a later call, fired at once)
# Collecting waits until SCRIPT ends or WAIT_S (default 540) passes, then packs its results ($RESULTS, i.e.
# /tmp/detached: SCRIPT writes there) into $OUT/results.tgz and prints the last lines of its log. A warm machine
# keeps /tmp and the Triton cache between back-to-back calls (it goes back ~30 s after a call); a cold one
# starts bare, so `collect` there says nothing ran. SCRIPT runs from the copy: later calls re-send the tree
# without disturbing it.
set -uo pipefail
cd "$(dirname "$0")/.."
export RESULTS=/tmp/detached
case "${1:-}" in
  start)
    shift
    [ $# -ge 1 ] || { echo "usage: $0 start SCRIPT [ARGS...]"; exit 2; }
    if [ -f "$RESULTS/started" ]; then
      echo "already started: collecting"
    else
      mkdir -p "$RESULTS" && rm -rf /tmp/ds4run && cp -r "$PWD" /tmp/ds4run && touch "$RESULTS/started"
      (cd /tmp/ds4run && setsid nohup bash -c 'bash "$@"; echo "exit $?" > "$RESULTS/done"' _ "$@" \
        > "$RESULTS/log.txt" 2>&1 < /dev/null &)
    fi
    ;;
  collect) [ -f "$RESULTS/started" ] || { echo "nothing started on this machine (a fresh one?)"; exit 1; } ;;
  *) echo "usage: $0 start SCRIPT [ARGS...] | collect"; exit 2 ;;
esac
end=$((SECONDS + ${WAIT_S:-540}))
while [ ! -f "$RESULTS/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
tar -czf "${OUT:-.out}/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
tail -n 20 "$RESULTS/log.txt"
if [ -f "$RESULTS/done" ]; then cat "$RESULTS/done"; else echo "still running: collect again"; fi
