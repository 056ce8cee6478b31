#!/usr/bin/env bash
# Packs a CUDA-capable build's test binary and kernel library so that a GPU machine can run the
# CUDA tests without building (a fresh build there takes about three minutes of GPU time).
#   tools/pack_cuda_tests.sh [BUILD]    BUILD: a configured build folder (default build/, as
#                                       `make test` leaves it: sm_90a as PTX, sm_80 as SASS)
# Rebuilds winnow_cuda_tests incrementally, strips the library and writes
# build-carry/cuda_tests.tgz (an ignored path, so it travels only where named: carry it with
# the GPU machine's `carry` list). On the GPU machine:
#   mkdir -p /tmp/carry && tar xzf build-carry/cuda_tests.tgz -C /tmp/carry
#   LD_LIBRARY_PATH=/tmp/carry:<the folder of libcudart.so.13> /tmp/carry/winnow_cuda_tests --gtest_filter='...'
# The driver compiles the compute_90a PTX of each kernel on first use (seconds per kernel, cached
# afterwards), so timings from such a binary are not comparable with a build there: use it for
# correctness and compute-sanitizer runs. A carried tree is limited to 64 MiB in all; the archive
# is about 23 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cmake --build "$build" --target winnow_cuda_tests -j"$(nproc)"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp "$build/libwinnow.so" "$build/tests/winnow_cuda_tests" "$stage/"
strip --strip-unneeded "$stage/libwinnow.so"
mkdir -p build-carry
tar czf build-carry/cuda_tests.tgz -C "$stage" libwinnow.so winnow_cuda_tests
ls -la build-carry/cuda_tests.tgz
