#!/usr/bin/env bash
# Work on the GPU machine that outlives one call (a call stops at 600 s; the machine stays
# warm while calls follow each other within about 30 s), from the repository root there:
#
#   tools/gpu_detached.sh start SCRIPT [ARGS...]   # copy the tree, start SCRIPT detached, poll
#   tools/gpu_detached.sh poll [SECONDS]           # in the next calls, back to back
#
# start copies the working tree, without its build folders, to $DETACHED_TREE (default
# /tmp/winnow-detached; where it exists, the working tree is copied over it, so that a second
# start on a warm machine runs the current sources and reuses the builds there) and runs
# SCRIPT there under setsid, so that a later call's fresh copy of the working tree cannot
# change files under it (a parked patch applied by the script, say). SCRIPT runs with $RESULTS (default /tmp/winnow-results) in its
# environment: it writes its logs there, and lines for people to $RESULTS/progress.txt. The
# launcher appends "DONE rc N" to progress.txt when SCRIPT exits.
# poll waits until SCRIPT has exited or SECONDS (default 540) have passed, prints
# progress.txt and the tail of SCRIPT's output, and packs $RESULTS into $OUT/results.tgz
# (files under 4 MB; left-behind.txt lists the others), so each call brings back what is there
# so far.
# start then polls for $POLL_SECONDS (default 540). Keep it a minute or more below the call's
# limit: a call stopped at its limit brings nothing back, not even what poll would have packed
# (2026-11-29, session 72: with 443 s of the session's GPU time left, a start that polled 540 s returned
# nothing). The limit is the call's timeout or less, when the session's GPU time is short.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
TREE=${DETACHED_TREE:-/tmp/winnow-detached}
RESULTS=${RESULTS:-/tmp/winnow-results}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$RESULTS" "$OUT"

poll() {
  local end=$(( $(date +%s) + ${1:-540} ))
  while (( $(date +%s) < end )) && ! grep -q '^DONE' "$RESULTS/progress.txt" 2> /dev/null; do
    sleep 5
  done
  echo "== $RESULTS/progress.txt"
  cat "$RESULTS/progress.txt" 2> /dev/null
  echo "== the script's output, last lines"
  tail -n 5 "$RESULTS/script.log" 2> /dev/null
  # Files of 4 MiB and more (Nsight reports, study checkpoints) stay behind: what comes back from
  # a call is capped, and one 193 MB study folder kept a whole results.tgz from coming back.
  # Sizes in bytes: find rounds a size up to whole units first, so -size -4M meant under 3 MiB
  # and +4M over 4, and a file in between went into neither list (an ncu source table of
  # session 79 came back nowhere).
  (cd "$(dirname "$RESULTS")" &&
    find "$(basename "$RESULTS")" -type f -size +4194303c > "$RESULTS/left-behind.txt" &&
    find "$(basename "$RESULTS")" -type f -size -4194304c -print0 | tar czf "$OUT/results.tgz" --null -T -)
}

case "${1:-}" in
  start)
    shift
    script=${1:?usage: tools/gpu_detached.sh start SCRIPT [ARGS...]}
    [[ -f "$script" ]] || { echo "gpu_detached: no script at '$script'" >&2; exit 2; }
    if [[ -e "$RESULTS/running" ]] && kill -0 "$(cat "$RESULTS/running")" 2> /dev/null; then
      echo "gpu_detached: a script is still running (pid $(cat "$RESULTS/running")); poll it" >&2
      exit 3
    fi
    # A build tree made here would not configure there (CMake records its directory); ccache
    # (tools/gpu_check.sh) makes the copy's build cheap. Where the copy exists (a second start
    # on a warm machine), its builds stay and the sources are copied over them: kept as they
    # were, a second start ran the first one's sources (files deleted here stay there).
    mkdir -p "$TREE" &&
      tar -cf - --exclude='./build*' --exclude='./gpu-out' . | tar -xf - -C "$TREE" || exit 1
    rm -f "$RESULTS/progress.txt"
    # The launcher records the script's exit status where poll looks for it.
    RESULTS="$RESULTS" setsid nohup bash -c \
      'cd "$0" && bash "$@"; echo "DONE rc $?" >> "$RESULTS/progress.txt"; rm -f "$RESULTS/running"' \
      "$TREE" "$@" > "$RESULTS/script.log" 2>&1 < /dev/null &
    echo $! > "$RESULTS/running"
    echo "gpu_detached: started $* in $TREE (pid $!); results in $RESULTS"
    poll "${POLL_SECONDS:-540}"
    ;;
  poll)
    poll "${2:-540}"
    ;;
  *)
    echo "usage: tools/gpu_detached.sh start SCRIPT [ARGS...] | poll [SECONDS]" >&2
    exit 2
    ;;
esac
