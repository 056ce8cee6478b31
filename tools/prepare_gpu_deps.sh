#!/usr/bin/env bash
# Copies the header-only libraries and GoogleTest's sources from this machine's Debian
# packages into .gpudeps/ (ignored by git), for a machine that cannot install packages:
#   tools/prepare_gpu_deps.sh && <carry .gpudeps> ; cmake -DWINNOW_DEPS_DIR=$PWD/.gpudeps ...
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh gpudeps
rm -rf .gpudeps
mkdir -p .gpudeps/json
cp -r /usr/include/eigen3 .gpudeps/eigen3
rm -rf .gpudeps/eigen3/unsupported
mkdir -p .gpudeps/CLI11 && cp -r /usr/include/CLI .gpudeps/CLI11/CLI
cp -r /usr/include/nlohmann .gpudeps/json/nlohmann
cp -r /usr/src/googletest .gpudeps/googletest
# ccache and the two libraries it links beyond libc (Debian's; the GPU machine is x86-64 too), so
# that tools/gpu_check.sh can rebuild only what changed when one call builds twice (an A/B).
if command -v ccache > /dev/null; then
  mkdir -p .gpudeps/bin .gpudeps/lib
  cp "$(command -v ccache)" .gpudeps/bin/
  ldd "$(command -v ccache)" | awk '/libhiredis|libzstd/ {print $3}' | xargs -r cp -t .gpudeps/lib/
fi
# Ninja (Debian's ninja-build: libc and libstdc++ only), so that the GPU build runs all its
# targets' files in one parallel build (tools/gpu_check.sh).
if command -v ninja > /dev/null; then
  mkdir -p .gpudeps/bin
  cp "$(command -v ninja)" .gpudeps/bin/
fi
du -sh .gpudeps
