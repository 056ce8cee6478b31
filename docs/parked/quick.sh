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
# 1. builds winnow_cuda_tests and winnow_torch, or $BUILD_TARGETS (tools/gpu_check.sh build);
# 2. runs the C++ CUDA tests in $TEST_FILTER in eight shards side by side ($TEST_REPEAT times
#    over, default once; a shard then has one summary a repeat), and beside them
#    compute-sanitizer racecheck over $RACE_FILTER and memcheck over $MEMCHECK_FILTER (none when
#    empty); then the model layer's CUDA tests in $MODEL_TEST_FILTER (none when empty), and the
#    Python CUDA tests (tests/python_cuda) when PYCUDA=1;
# 3. bench/kernel_breakdown.py $BREAKDOWN (none when empty): the kernels' times, to set against
#    an earlier run's on main; once per word of $BREAKDOWN_VARIANTS when given, each word an
#    environment assignment for that run (WINNOW_...=value);
# 4. tools/ncu_summary.sh $NCU (none when empty), its report left out (too large).
# Every step has a time limit ($*_SECONDS), so that the call returns what it has before its own
# limit: a call stopped at its limit brings nothing back. The summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# At most 8 files come back from a call (device README): every log goes to $L, packed into
# $OUT/quick-logs.tgz at the end, with the progress, breakdown and ncu summaries beside it.
L=/tmp/quick-logs
rm -rf "$L" && mkdir -p "$L"
pack() {
  rm -f "$L"/*.ncu-rep
  tar czf "$OUT/quick-logs.tgz" -C "$(dirname "$L")" "$(basename "$L")"
  for f in progress.txt breakdown.txt ncu.txt; do [[ -f "$L/$f" ]] && cp "$L/$f" "$OUT/"; done
  return 0
}
trap pack EXIT
START=$(date +%s)
P=$L/progress.txt
say() { echo "[$(( $(date +%s) - START )) s] $*" >> "$P"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$P" 2>&1

BUILD_TARGETS="${BUILD_TARGETS:-winnow_cuda_tests winnow_torch}" OUT=$L timeout "${BUILD_SECONDS:-300}" tools/gpu_check.sh build \
  > "$L/build.log" 2>&1
rc=$?
say "build: rc $rc"
if (( rc != 0 )); then
  tail -30 "$L/build.log"
  exit 1
fi

T=build-gpu/tests/winnow_cuda_tests
if [[ -n "${TEST_FILTER:-}" ]]; then
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout "${TEST_SECONDS:-120}" "$T" --gtest_filter="$TEST_FILTER" \
      --gtest_repeat="${TEST_REPEAT:-1}" \
      > "$L/tests-$i.log" 2>&1 &
  done
fi
if [[ -n "${RACE_FILTER:-}" ]]; then
  timeout "${TEST_SECONDS:-120}" compute-sanitizer --tool racecheck --error-exitcode 9 "$T" \
    --gtest_filter="$RACE_FILTER" > "$L/racecheck.log" 2>&1 &
fi
if [[ -n "${MEMCHECK_FILTER:-}" ]]; then
  timeout "${TEST_SECONDS:-120}" compute-sanitizer --tool memcheck --error-exitcode 9 "$T" \
    --gtest_filter="$MEMCHECK_FILTER" > "$L/memcheck.log" 2>&1 &
fi
wait
if [[ -n "${TEST_FILTER:-}" ]]; then
  for i in 0 1 2 3 4 5 6 7; do
    # A shard that its limit cut off has no summary line: name the test it was in.
    summary=$(grep -E '^\[  (PASSED|FAILED)  \]' "$L/tests-$i.log" | tr '\n' ' ')
    [[ -n $summary ]] || summary="cut off in $(grep -E '^\[ RUN      \]' "$L/tests-$i.log" | tail -1)"
    say "tests, shard $i: $summary"
  done
fi
[[ -z "${RACE_FILTER:-}" ]] || say "racecheck: $(grep -E 'PASSED|FAILED|RACECHECK SUMMARY' "$L/racecheck.log" | tr '\n' ' ')"
[[ -z "${MEMCHECK_FILTER:-}" ]] || say "memcheck: $(grep -E 'PASSED|FAILED|ERROR SUMMARY' "$L/memcheck.log" | tr '\n' ' ')"
if [[ -n "${MODEL_TEST_FILTER:-}" ]]; then
  # The model layer's CUDA tests (add winnow_model_cuda_tests to BUILD_TARGETS).
  timeout "${TEST_SECONDS:-120}" build-gpu/tests/winnow_model_cuda_tests --gtest_filter="$MODEL_TEST_FILTER" \
    > "$L/model-tests.log" 2>&1
  say "model tests: rc $? $(grep -E '^\[  (PASSED|FAILED)  \]|^\[  FAILED' "$L/model-tests.log" | tr '\n' ' ')"
fi

export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
if [[ "${PYCUDA:-0}" == 1 ]]; then
  PYTHONPATH="$PWD/python:$PWD/tests/python" timeout "${TEST_SECONDS:-120}" \
    python3 -m pytest -q -p no:cacheprovider tests/python_cuda > "$L/pycuda.log" 2>&1
  say "python CUDA tests: rc $? $(tail -1 "$L/pycuda.log")"
fi
if [[ -n "${BREAKDOWN:-}" && -n "${BREAKDOWN_VARIANTS:-}" ]]; then
  # One breakdown per variant, each an environment assignment (NAME=value) for its run.
  for variant in $BREAKDOWN_VARIANTS; do
    # shellcheck disable=SC2086  # the arguments are words
    env "$variant" timeout "${BREAKDOWN_SECONDS:-100}" python3 bench/kernel_breakdown.py $BREAKDOWN \
      > "$L/breakdown-variant.txt" 2>&1
    say "kernel breakdown, $variant: rc $?"
    { echo "=== $variant"; cat "$L/breakdown-variant.txt"; } >> "$L/breakdown.txt"
  done
elif [[ -n "${BREAKDOWN:-}" ]]; then
  # shellcheck disable=SC2086  # the arguments are words
  timeout "${BREAKDOWN_SECONDS:-100}" python3 bench/kernel_breakdown.py $BREAKDOWN > "$L/breakdown.txt" 2>&1
  say "kernel breakdown: rc $?"
fi
if [[ -n "${NCU:-}" ]]; then
  # shellcheck disable=SC2086
  OUT=$L NCU_NAME_BASE=${NCU_NAME_BASE:-demangled} timeout "${NCU_SECONDS:-120}" tools/ncu_summary.sh $NCU \
    > "$L/ncu.txt" 2>&1
  say "ncu: rc $?"
  rm -f "$L"/*.ncu-rep
fi

cat "$P"
[[ -f "$L/breakdown.txt" ]] && grep -v -E 'not available|UserWarning|_warn_once' "$L/breakdown.txt"
[[ -f "$L/ncu.txt" ]] && head -20 "$L/ncu.txt"
exit 0
