#!/usr/bin/env bash
# The parked patches' measurements in two GPU calls, from the
# repository root with all three applied (they touch disjoint files):
#   for p in docs/parked/*.patch; do git apply "$p"; done
#   bash docs/parked/run_ab.sh test     # GPU call 1 (about 8.5 minutes): build, the CUDA suite
#   bash docs/parked/run_ab.sh bench    # GPU call 2 (about 4 minutes, plus 3 for a build if the
#                                       # machine went cold): the A/B; $OUT gets ab.txt
# Builds, runs the CUDA suite (every mechanism's kernels, the deterministic mode among them),
# then three alternating runs of each order against the landed one (environment switches of the
# two interleaving patches), and stick-breaking / Sieve with exp2 on the FMA pipe (no switch:
# compare with docs/performance.md's table of the same shapes, or build main beside it).
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
t0=$(date +%s)
if [[ "${1:-}" == test || ! -x build-gpu/tests/winnow_cuda_tests ]]; then
  BUILD_TARGETS="winnow_torch winnow_cuda_tests" tools/gpu_check.sh build > /tmp/parked_build.log 2>&1 \
    || { tail -40 /tmp/parked_build.log; exit 1; }
  echo "built $(( $(date +%s) - t0 )) s"
fi
if [[ "${1:-}" == test ]]; then
timeout 330 ctest --test-dir build-gpu -L cuda -j 8 --timeout 100 > "$OUT/parked_cuda_tests.log" 2>&1
echo "ctest rc $? $(grep -E 'tests passed|tests failed' "$OUT/parked_cuda_tests.log" | tail -1)"
grep -E "\(Failed\)|\(Timeout\)" "$OUT/parked_cuda_tests.log" | head -20
echo "elapsed $(( $(date +%s) - t0 )) s"
exit 0
fi
ARGS="--tokens 32768 --heads 16 --lengths 8192 32768 --dims 128 64"
bench() { timeout 90 python3 bench/gpu_attention_bench.py $ARGS "$@" 2>&1 | grep -E "^ +(64|128) "; }
{
  for r in 1 2 3; do
    echo "== run $r: both interleavings on"
    bench --methods sdpa_flash sdpa_cudnn winnow_softmax winnow_stick_breaking winnow_sieve_bound
    echo "== run $r: both interleavings off (landed orders)"
    WINNOW_HEADS_PER_SWEEP=1 WINNOW_SOFTMAX_KEYS_HEADS_PER_SWEEP=1 bench --methods winnow_softmax winnow_stick_breaking
  done
} | tee "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"
