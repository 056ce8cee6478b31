#!/usr/bin/env bash
# The working tree's checks, then A/Bs of parked patches against it, in one detached run on the
# GPU machine (a session's validation and its next measurement share one build and one start):
#
#   TEST_FILTER='*Threshold*:*Screen*' PYCUDA=1 RACE_FILTER=... MEMCHECK_FILTER=... \
#   PATCHES=NAME LENGTHS='4096 16384' tools/gpu_detached.sh start docs/parked/check_then_ab.sh
#
# 1. docs/parked/quick.sh on the tree as it is (its variables: the build, the C++ CUDA tests in
#    shards, the sanitizers, the Python CUDA tests), its logs under $RESULTS/quick;
# 2. when PATCHES names parked patches, docs/parked/screen_patches.sh on them (its variables),
#    in the same build tree; otherwise, when BENCH_METHODS names rows of the threshold bench
#    (say "winnow_tra winnow_tra_beta1_screen"), that bench on the tree as it is, its JSON in
#    $RESULTS/bench.json and tools/issue_bars.py's issue 14 rows in progress.txt, then
#    tools/screen_consistency.py.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
mkdir -p "$R"
OUT=$R/quick docs/parked/quick.sh > "$R/quick.txt" 2>&1
echo "[quick.sh] rc $?" >> "$R/progress.txt"
cat "$R/quick/progress.txt" >> "$R/progress.txt" 2> /dev/null
if [[ -n ${PATCHES:-} ]]; then
  RESULTS=$R docs/parked/screen_patches.sh
fi
if [[ -z ${PATCHES:-} && -n ${BENCH_METHODS:-} ]]; then
  export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
  # shellcheck disable=SC2086  # the methods are words
  timeout 300 python3 bench/gpu_threshold_bench.py --methods $BENCH_METHODS --json "$R/bench.json" \
    > "$R/bench.txt" 2>&1
  echo "[bench] rc $?" >> "$R/progress.txt"
  grep -E '^ +[0-9]+ ' "$R/bench.txt" >> "$R/progress.txt"
  python3 tools/issue_bars.py "$R/bench.json" 2>&1 | grep -E '^ +14 ' >> "$R/progress.txt"
  timeout 120 python3 tools/screen_consistency.py --lengths 4096 16384 --repeats 3 > "$R/consistency.txt" 2>&1
  echo "[consistency] rc $?, $(grep -c MISMATCH "$R/consistency.txt") mismatches" >> "$R/progress.txt"
fi
