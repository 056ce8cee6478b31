#!/usr/bin/env bash
# `pip install .` as a user does it, then the Python tests against the installed package,
# run from outside the repository with nothing pointing at build/ or python/ (the tests check
# that `winnow` and its library come from the install: WINNOW_EXPECT_INSTALLED).
#   tools/check_pip_install.sh [PYTHON]      (default: /usr/bin/python3 when it has torch)
# A system Python (Debian's, with python3-torch): a fresh virtual environment that sees the
# system's packages, installed into with pip's build isolation (pip fetches scikit-build-core).
# A Python that is itself a virtual environment (the GPU machine's, with a CUDA torch): built
# against that torch without isolation (scikit-build-core from the wheels in .whl/, no network)
# and installed with --target into a folder of its own; its CUDA kernels are built for the GPU
# present (or $WINNOW_CUDA_ARCHITECTURES).
# With a system Python it then checks `pip install -e .` too: the package from the source tree,
# the library from the environment. scikit-build-core builds an editable install in a folder
# of its own, so both builds go through ccache where it is installed (build/ccache, which `make
# test`'s build fills first): the pip builds then compile little or nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-}
if [[ -z "$python" ]]; then
  if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    python=/usr/bin/python3
  else
    python=python3
  fi
fi
work=${WINNOW_PIP_CHECK_DIR:-$root/build/pip-check}
rm -rf "$work"
mkdir -p "$work"
if command -v ccache >/dev/null && [[ -z "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]]; then
  # CMake reads the launcher from the environment; the build folders differ, the sources don't.
  # build/ccache is also where `make test`'s own build put the library's files (CMakeLists.txt,
  # WINNOW_CCACHE_DIR). The same compiler as that build's (CMake's default, c++): Debian's
  # Python would otherwise name x86_64-linux-gnu-g++, which ccache counts as another compiler.
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  # No CCACHE_BASEDIR: absolute paths keep the preprocessed text the same in every build folder.
  export CCACHE_DIR="${WINNOW_CCACHE_DIR:-$root/build/ccache}" CCACHE_NOHASHDIR=1
  unset CCACHE_BASEDIR
  export CXX="${CXX:-c++}"
fi
start=$(date +%s)
if "$python" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
  tools="$work/build-tools"
  "$python" -m pip install -q --no-index --no-deps --target "$tools" "$root"/.whl/scikit_build_core-*.whl \
    "$root"/.whl/pathspec-*.whl
  PYTHONPATH="$tools" "$python" -m pip install -q --no-deps --no-build-isolation --no-cache-dir \
    --target "$work/site" "$root"
  prefix="$work/site"
  run_python=("env" "PYTHONPATH=$work/site" "$python")
else
  "$python" -m venv --system-site-packages "$work/venv"
  "$work/venv/bin/python" -m pip install -q --no-deps --no-cache-dir "$root"
  prefix="$work/venv"
  run_python=("$work/venv/bin/python")
fi
echo "pip install: $(( $(date +%s) - start )) s"
cd "$work"
env -u PYTHONPATH -u WINNOW_LIBRARY WINNOW_EXPECT_INSTALLED="$prefix" \
  "${run_python[@]}" -m pytest -q -p no:cacheprovider "$root/tests/python" ${WINNOW_PIP_CHECK_TESTS:-}

if [[ "$prefix" == "$work/venv" ]]; then
  start=$(date +%s)
  "$python" -m venv --system-site-packages "$work/venv-editable"
  "$work/venv-editable/bin/python" -m pip install -q --no-deps --no-cache-dir -e "$root"
  echo "pip install -e: $(( $(date +%s) - start )) s"
  env -u PYTHONPATH -u WINNOW_LIBRARY WINNOW_EXPECT_EDITABLE="$work/venv-editable" \
    "$work/venv-editable/bin/python" -m pytest -q -p no:cacheprovider "$root/tests/python/test_ops.py"
fi
