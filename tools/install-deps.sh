#!/usr/bin/env bash
# Installs the Debian packages winnow builds and tests with, only those missing.
#   tools/install-deps.sh          build + tests
#   tools/install-deps.sh bench    also what the CPU benchmark compares against
#   tools/install-deps.sh gpudeps  also what tools/prepare_gpu_deps.sh copies (ninja)
#   tools/install-deps.sh corpus   only the language-modeling corpus's source: the Linux
#                                  kernel's documentation (linux-doc, GPL-2.0)
set -euo pipefail

# libplplot-dev: the plots of `winnow study`. python3-venv: the environment `pip install .` is
# checked in (tools/check_pip_install.sh).
# libopenblas0-pthread: Debian's LibTorch links the reference BLAS unless an optimized one is
# installed (it then takes over libblas.so.3 through Debian's alternatives); the model tests
# train small transformers and run about 20x slower on the reference BLAS.
# libgloo-dev: the headers c10d's gloo process group needs (data-parallel training, its tests).
# ccache: `pip install -e .` after `pip install .` in tools/check_pip_install.sh compiles the
# same sources again in a build folder of its own; the cache makes that seconds instead of two
# minutes.
packages=(cmake g++ make libeigen3-dev libgtest-dev libcli11-dev nlohmann-json3-dev
          libtorch-dev python3-torch python3-pytest libopenblas0-pthread pkg-config
          libplplot-dev python3-venv libgloo-dev ccache)
if [[ "${1:-}" == "corpus" ]]; then
  packages=(linux-doc python3)
fi
if [[ "${1:-}" == "gpudeps" ]]; then
  # The build tool tools/prepare_gpu_deps.sh copies for the GPU machine's build.
  packages+=(ninja-build)
fi
if [[ "${1:-}" == "bench" ]]; then
  # An optimized BLAS for LibTorch's composed baseline (Debian's default is the reference BLAS).
  packages+=(libopenblas0-pthread)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "installing: ${missing[*]}"
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
