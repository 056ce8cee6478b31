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
#    in the same build tree.
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
