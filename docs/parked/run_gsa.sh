#!/usr/bin/env bash
# The parked GSA patch measured in one GPU call (about 7 minutes), from the repository root:
#   git apply docs/parked/gsa-indexer-statistics-on-tensor-cores.patch
#   bash docs/parked/run_gsa.sh        # $OUT gets gsa_tests.log, sanitize logs, gsa_ab.txt
# Builds, runs the GSA CUDA tests, compute-sanitizer memcheck and racecheck over the selection
# tests, then GSA's bench with the statistics pass on tensor cores (default) and with
# WINNOW_GSA_SCALAR_STATISTICS=1 (every pass in select_keys_kernel, the landed code), twice each.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
BUILD_TARGETS="winnow_torch winnow_cuda_tests" tools/gpu_check.sh build > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "built $(( $(date +%s) - t0 )) s"
timeout 120 build-gpu/tests/winnow_cuda_tests --gtest_filter='CudaGsa*' > "$OUT/gsa_tests.log" 2>&1
echo "gsa tests rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gsa_tests.log" | tr '\n' ' ')"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/winnow_cuda_tests \
    --gtest_filter='CudaGsaSelection.*' > "$OUT/sanitize_gsa_$tool.log" 2>&1
  echo "$tool rc $? $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitize_gsa_$tool.log" | tail -1)"
done
export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
{
  for r in 1 2; do
    echo "== run $r: statistics on tensor cores"
    timeout 90 python3 bench/gpu_gsa_bench.py --lengths 16384 --full-lists
    echo "== run $r: WINNOW_GSA_SCALAR_STATISTICS=1 (landed)"
    WINNOW_GSA_SCALAR_STATISTICS=1 timeout 90 python3 bench/gpu_gsa_bench.py --lengths 16384 --full-lists
  done
} 2>&1 | tee "$OUT/gsa_ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"
