#!/usr/bin/env bash
# A patch's check in one call, for a session with little GPU time left (about 6 minutes with a
# cold build; the detached measure.sh needs 20 and more). Run from the repository root on the
# GPU machine, on the working tree as it is (apply the patch here first; carry .gpudeps):
#
#   TEST_FILTER='*entmax*:*sieve*' RACE_FILTER='CudaEntmax.TheForwards*' \
#   BREAKDOWN='--lengths 4096 --methods winnow_entmax15' \
#   NCU='entmax-listed EntmaxListedRows -- python3 tools/profile_attention.py --mechanism entmax15 --length 4096' \
#   docs/parked/quick.sh
#
# 1. builds winnow_cuda_tests and winnow_torch (tools/gpu_check.sh build);
# 2. runs the C++ CUDA tests in $TEST_FILTER in eight shards side by side, and beside them
#    compute-sanitizer racecheck over $RACE_FILTER (none when empty);
# 3. bench/kernel_breakdown.py $BREAKDOWN (none when empty): the kernels' times, to set against
#    an earlier run's on main;
# 4. tools/ncu_summary.sh $NCU (none when empty), its report left out of $OUT (too large).
# Every step has a time limit ($*_SECONDS), so that the call returns what it has before its own
# limit: a call stopped at its limit brings nothing back. The summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
P=$OUT/progress.txt
say() { echo "[$(( $(date +%s) - START )) s] $*" >> "$P"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$P" 2>&1

BUILD_TARGETS="winnow_cuda_tests winnow_torch" OUT=$OUT timeout "${BUILD_SECONDS:-300}" tools/gpu_check.sh build \
  > "$OUT/build.log" 2>&1
rc=$?
say "build: rc $rc"
if (( rc != 0 )); then
  tail -30 "$OUT/build.log"
  exit 1
fi

T=build-gpu/tests/winnow_cuda_tests
if [[ -n "${TEST_FILTER:-}" ]]; then
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout "${TEST_SECONDS:-120}" "$T" --gtest_filter="$TEST_FILTER" \
      > "$OUT/tests-$i.log" 2>&1 &
  done
fi
if [[ -n "${RACE_FILTER:-}" ]]; then
  timeout "${TEST_SECONDS:-120}" compute-sanitizer --tool racecheck --error-exitcode 9 "$T" \
    --gtest_filter="$RACE_FILTER" > "$OUT/racecheck.log" 2>&1 &
fi
wait
if [[ -n "${TEST_FILTER:-}" ]]; then
  for i in 0 1 2 3 4 5 6 7; do
    # A shard that its limit cut off has no summary line: name the test it was in.
    summary=$(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/tests-$i.log" | tr '\n' ' ')
    [[ -n $summary ]] || summary="cut off in $(grep -E '^\[ RUN      \]' "$OUT/tests-$i.log" | tail -1)"
    say "tests, shard $i: $summary"
  done
fi
[[ -z "${RACE_FILTER:-}" ]] || say "racecheck: $(grep -E 'PASSED|FAILED|RACECHECK SUMMARY' "$OUT/racecheck.log" | tr '\n' ' ')"

export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
if [[ -n "${BREAKDOWN:-}" ]]; then
  # shellcheck disable=SC2086  # the arguments are words
  timeout "${BREAKDOWN_SECONDS:-100}" python3 bench/kernel_breakdown.py $BREAKDOWN > "$OUT/breakdown.txt" 2>&1
  say "kernel breakdown: rc $?"
fi
if [[ -n "${NCU:-}" ]]; then
  # shellcheck disable=SC2086
  OUT=$OUT NCU_NAME_BASE=${NCU_NAME_BASE:-demangled} timeout "${NCU_SECONDS:-120}" tools/ncu_summary.sh $NCU \
    > "$OUT/ncu.txt" 2>&1
  say "ncu: rc $?"
  rm -f "$OUT"/*.ncu-rep
fi

cat "$P"
[[ -f "$OUT/breakdown.txt" ]] && grep -v -E 'not available|UserWarning|_warn_once' "$OUT/breakdown.txt"
[[ -f "$OUT/ncu.txt" ]] && head -20 "$OUT/ncu.txt"
exit 0
