#!/usr/bin/env bash
# The operator tests that need PyTorch >= 2.4 (torch.library.opcheck, torch.compile with dynamic
# shapes, the Meta kernels under fake tensors: tests/python/test_torch_machinery.py), run on a
# machine without a GPU. Debian's python3-torch (1.13) skips them, so without this they only run
# on the GPU machine, where a failure costs a build there.
#   tools/modern_torch_cpu.sh [pytest arguments]     (default: the machinery, ops and nn tests)
# Makes a virtual environment in $VENV (default /tmp/winnow-torch-venv) holding PyPI's torch
# ($TORCH_VERSION, default 2.11.0: the GPU machine's) without its CUDA libraries, except the three
# its libraries link against and the toolkit here lacks; builds winnow_torch against it in
# $BUILD (default /tmp/winnow-build-modern-torch, CPU kernels only); runs pytest. About 1 GB to
# download the first time; later runs rebuild incrementally.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-/tmp/winnow-torch-venv}
build=${BUILD:-/tmp/winnow-build-modern-torch}
version=${TORCH_VERSION:-2.11.0}
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  # The torch wheel alone (its CUDA dependencies are gigabytes): its libraries still link
  # against cuFile, cuSPARSELt and NVSHMEM, which the CUDA toolkit here does not ship.
  "$venv/bin/pip" install -q --no-deps "torch==$version"
  # Those three at the versions torch pins (cuda-toolkit with only its cufile extra).
  mapfile -t pinned < <("$venv/bin/python" - <<'PY'
import re
from importlib.metadata import requires
for r in requires("torch") or []:
    name = re.match(r"[A-Za-z0-9_.-]+", r).group(0)
    version = re.search(r"==\s*([^;,\s]+)", r)
    if name in ("nvidia-nvshmem-cu13", "nvidia-cusparselt-cu13", "cuda-toolkit") and version:
        print(("cuda-toolkit[cufile]" if name == "cuda-toolkit" else name) + "==" + version.group(1))
PY
)
  "$venv/bin/pip" install -q numpy pytest filelock typing-extensions sympy networkx jinja2 fsspec "${pinned[@]}"
fi
prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
lib=$("$venv/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
# c10 named explicitly: TorchConfig's find_library would otherwise take Debian's libc10.so from
# the system folders, and a library linked against both torches crashes.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DWINNOW_CUDA=OFF \
  -DWINNOW_TORCH=ON -DWINNOW_PYTHON="$venv/bin/python" -Dc10_LIBRARY="$lib/libc10.so" > "$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target winnow_torch
cd "$root"
if [[ $# -eq 0 ]]; then
  set -- -q tests/python/test_torch_machinery.py tests/python/test_ops.py tests/python/test_nn.py
fi
WINNOW_LIBRARY="$build/libwinnow_torch.so" PYTHONPATH="$root/python:$root/tests/python" \
  LD_LIBRARY_PATH= "$venv/bin/python" -m pytest "$@"
