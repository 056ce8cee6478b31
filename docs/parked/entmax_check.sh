#!/usr/bin/env bash
# A change to entmax's or Sieve's kernels checked in one run on the GPU machine (about 10
# minutes, over two calls; carry .gpudeps and .whl):
#
#   tools/gpu_detached.sh start docs/parked/entmax_check.sh     # then: tools/gpu_detached.sh poll
#
# the build and the entmax, sparsemax and Sieve tests on the Hopper kernels with racecheck and
# memcheck over the published-search and support-list tests (docs/parked/quick.sh), the same
# tests on the portable kernels (eight shards), the Python CUDA tests of entmax and Sieve, then
# issue 10's bench beside SDPA and AdaSplash-2 with its bars (tools/gpu_check.sh bench), and a
# host trace of entmax-1.5's 4K forward. Session 81 (2026-11-30) landed its change on this run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
mkdir -p "$R"
P=$R/progress.txt
START=$(date +%s)
say() { echo "[$(( $(date +%s) - START )) s] $*" >> "$P"; }
F='*entmax*:*Entmax*:*sieve*:*Sieve*:*parsemax*'
OUT=$R/q1 TEST_FILTER="$F" RACE_FILTER='CudaEntmax.PublishedSearches*' \
  MEMCHECK_FILTER='CudaEntmax.PublishedSearches*:CudaEntmax.TheForwards*' TEST_SECONDS=200 \
  docs/parked/quick.sh > "$R/q1.log" 2>&1
cp /tmp/quick-logs/progress.txt "$R/q1-progress.txt"; cp /tmp/quick-logs/racecheck.log /tmp/quick-logs/memcheck.log "$R/" 2>/dev/null
say "hopper kernels: $(grep -E 'tests, shard|racecheck|memcheck|build' /tmp/quick-logs/progress.txt | tr '\n' ' ')"
for i in 0 1 2 3 4 5 6 7; do
  WINNOW_PORTABLE_KERNELS=1 GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 200 build-gpu/tests/winnow_cuda_tests \
    --gtest_filter="$F" > "$R/portable-$i.log" 2>&1 &
done
wait
say "portable kernels: $(grep -h -E '^\[  (PASSED|FAILED)  \]' "$R"/portable-*.log | tr '\n' ' ')"
export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
PYTHONPATH="$PWD/python:$PWD/tests/python" timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python_cuda \
  -k "entmax or sieve or Entmax or Sieve" > "$R/pycuda.log" 2>&1
say "python CUDA tests (entmax, sieve): rc $? $(tail -1 "$R/pycuda.log")"
BENCH_ARGS="--lengths 4096 16384 --dims 128 --methods sdpa_flash sdpa_cudnn winnow_entmax15 adasplash2_entmax15 winnow_sieve_exact winnow_sieve_bound" \
  OUT=$R/bench tools/gpu_check.sh bench > "$R/bench.log" 2>&1
say "bench: rc $?"
tail -20 "$R/bench.log" >> "$P"
python3 bench/kernel_breakdown.py --lengths 4096 --methods winnow_entmax15 --phases forward --host-trace 45 \
  > "$R/host-trace.txt" 2>&1
say "host trace: rc $?"
