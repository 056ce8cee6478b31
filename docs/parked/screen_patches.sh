#!/usr/bin/env bash
# The parked screen patches, each against main (they do not stack), on the GPU machine:
#
#   tools/gpu_detached.sh start docs/parked/screen_patches.sh   # then tools/gpu_detached.sh poll
#
# For each patch in $PATCHES (names in the parked README) an A/B in one build tree (tools/parked_ab.sh, $AB_ROUNDS rounds, back on main after
# each), every round the kernel breakdown of the screened rows at beta 1 and 0 and
# tools/screen_consistency.py; on the patched tree also the threshold tests (main's pass:
# they run first, once). Results under $RESULTS (tools/gpu_detached.sh): ab-NAME/ per patch,
# progress.txt with each A/B's summary and the screen's and candidate pass's kernel times.
# About 5 minutes a patch after main's build (2-3), by session 84's timings.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
P=$R/progress.txt
mkdir -p "$R"
START=$(date +%s)
say() { echo "[$(( $(date +%s) - START )) s] $*" >> "$P"; }
export BUILD_TARGETS=${BUILD_TARGETS:-"winnow_cuda_tests winnow_torch"}
TESTS="build-gpu/tests/winnow_cuda_tests --gtest_filter='Threshold*:CudaSmall.*:*Screen*' --gtest_brief=1"
# BREAKDOWN_METHODS: the rows of the kernel breakdown (default the screened ones at beta 1 and 0).
BREAKDOWN_METHODS=${BREAKDOWN_METHODS:-"winnow_tra_beta1_screen winnow_tda_beta1_screen winnow_tra_screen winnow_tda_screen"}
# HOST_TRACE=N: each row's breakdown also prints one call's first N host and GPU events.
BREAKDOWN="python3 bench/kernel_breakdown.py --lengths ${LENGTHS:-2048 4096 16384} --methods $BREAKDOWN_METHODS \
--phases forward --calls 5 --host-trace ${HOST_TRACE:-0}"
CONSISTENCY="python3 tools/screen_consistency.py --lengths 4096 16384 --repeats 3"
# BENCH_METHODS (say "winnow_tra winnow_tra_beta1 winnow_tda winnow_tda_beta1"): also the threshold
# bench of those rows every round, its JSON beside the round's (tools/issue_bars.py reads it).
BENCH=${BENCH_METHODS:+"; python3 bench/gpu_threshold_bench.py --methods $BENCH_METHODS --json @AB_JSON@ > @AB_JSON@.bench.txt 2>&1"}
first=1
for patch in ${PATCHES:?name the parked patches to measure}; do
  # Main's tests once, in the first A/B's first main round; each patched tree's in its rounds.
  command="if [ \"\$AB_TREE\" = patch ] || [ $first = 1 ]; then $TESTS > @AB_JSON@.tests.txt 2>&1; fi; \
$BREAKDOWN > @AB_JSON@.kernels.txt 2>&1; $CONSISTENCY > @AB_JSON@.consistency.txt 2>&1$BENCH"
  say "A/B $patch"
  OUT=$R/ab-$patch AB_END=main tools/parked_ab.sh "docs/parked/$patch.patch" -- bash -c "$command" \
    > "$R/ab-$patch.txt" 2>&1
  say "A/B $patch: rc $?"
  first=0
  grep -E '^build|^round|FAILED' "$R/ab-$patch/ab-summary.txt" >> "$P" 2>&1
  for f in "$R"/ab-$patch/ab-*-[0-9].json.tests.txt; do
    [[ -f $f ]] && say "  $(basename "$f" .json.tests.txt) tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$f" | tr '\n' ' ')"
  done
  for f in "$R"/ab-$patch/ab-*-[0-9].json.consistency.txt; do
    [[ -f $f ]] && say "  $(basename "$f" .json.consistency.txt) consistency: $(grep -c MISMATCH "$f") mismatches"
  done
  for f in "$R"/ab-$patch/ab-*-[0-9].json; do
    [[ -f $f ]] && { echo "-- $(basename "$f" .json) bars" >> "$P"; python3 tools/issue_bars.py "$f" 2>&1 | grep -E '^ +14 ' >> "$P"; }
  done
  for f in "$R"/ab-$patch/ab-*-[0-9].json.kernels.txt; do
    [[ -f $f ]] || continue
    echo "-- $(basename "$f" .json.kernels.txt)" >> "$P"
    grep -E '^## |threshold_screen|threshold_candidates|attention_forward_sm90' "$f" | sed -E 's/ ms of kernels per call.*\(([0-9.]+) with.*/ kernels, \1 hidden/' \
      | cut -c1-110 >> "$P"
  done
done
# FINAL_TREE=patch: what follows runs on the last patch's tree instead of main's (applied and
# built here), and FINAL_BENCH_METHODS (say "winnow_tra winnow_tra_beta1_screen") runs the
# threshold bench once there, with tools/issue_bars.py on it.
final=main
if [[ ${FINAL_TREE:-main} == patch ]]; then
  git apply "docs/parked/$patch.patch" && OUT=$R/build-final timeout 600 tools/gpu_check.sh build > "$R/build-final.txt" 2>&1
  say "final tree: the patch $patch applied and built: rc $?"
  final=patch
fi
if [[ -n ${FINAL_BENCH_METHODS:-} ]]; then
  # shellcheck disable=SC2086
  WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so timeout 400 python3 bench/gpu_threshold_bench.py \
    --methods $FINAL_BENCH_METHODS --json "$R/bench-$final.json" > "$R/bench-$final.txt" 2>&1
  say "bench on $final: rc $?"
  python3 tools/issue_bars.py "$R/bench-$final.json" 2>&1 | grep -E '^ +14 ' >> "$P"
fi
# SANITIZE_FILTER: then racecheck and memcheck over those tests on that tree's build, each
# under SANITIZE_SECONDS (default 240).
if [[ -n ${SANITIZE_FILTER:-} ]]; then
  for tool in racecheck memcheck; do
    timeout "${SANITIZE_SECONDS:-240}" compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/winnow_cuda_tests \
      --gtest_filter="$SANITIZE_FILTER" --gtest_brief=1 > "$R/$final-$tool.txt" 2>&1
    say "$final $tool over $SANITIZE_FILTER: rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED)' "$R/$final-$tool.txt" | tr '\n' ' ')"
  done
fi
# NCU_RUNS: then Nsight Compute summaries (tools/ncu_summary.sh) on that tree's build, entries
# separated by ';', each "NAME KERNEL_REGEX ARGS" with ARGS those of tools/profile_attention.py
# (say "tra-beta1-16k attention_forward_sm90 --mechanism tra --beta 1 --length 16384"); each
# under NCU_SECONDS (default 180), its summary in $R/ncu-NAME.txt.
if [[ -n ${NCU_RUNS:-} ]]; then
  IFS=';' read -ra runs <<< "$NCU_RUNS"
  for run in "${runs[@]}"; do
    read -r name regex args <<< "$run"
    # shellcheck disable=SC2086
    OUT=$R timeout "${NCU_SECONDS:-180}" tools/ncu_summary.sh "$name" "$regex" -- python3 tools/profile_attention.py $args \
      > "$R/ncu-$name.txt" 2>&1
    say "ncu $name: rc $?"
    rm -f "$R/$name.ncu-rep"
  done
fi
say "screen_patches.sh done"
