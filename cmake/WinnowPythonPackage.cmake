# The build behind `pip install .` (pyproject.toml sets WINNOW_PYTHON_PACKAGE): build against
# the torch that the installing Python imports, and CUDA kernels only when that torch has CUDA.
# Included before the CUDA and LibTorch sections of CMakeLists.txt.
set(_winnow_python "${Python_EXECUTABLE}")
if(NOT _winnow_python)
  set(_winnow_python "${Python3_EXECUTABLE}")
endif()
set(WINNOW_PACKAGE_TORCH_VERSION "")
if(_winnow_python)
  execute_process(
    COMMAND "${_winnow_python}" -c [=[
import torch
print(torch.utils.cmake_prefix_path)
print(torch.__version__.split("+")[0])
print(torch.version.cuda or "")
arch = ""
if torch.version.cuda and torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}a" if major == 9 else f"{major}{minor}"
print(arch)
print("end")
]=]
    RESULT_VARIABLE _winnow_torch_rc OUTPUT_VARIABLE _winnow_torch_out ERROR_QUIET
    OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
if(_winnow_python AND _winnow_torch_rc EQUAL 0)
  string(REPLACE "\n" ";" _winnow_torch_out "${_winnow_torch_out}")
  list(GET _winnow_torch_out 0 _winnow_torch_prefix)
  list(GET _winnow_torch_out 1 WINNOW_PACKAGE_TORCH_VERSION)
  list(GET _winnow_torch_out 2 _winnow_torch_cuda)
  list(GET _winnow_torch_out 3 _winnow_gpu_arch)
  # The torch package's root first: its lib/ then wins over a system LibTorch (Debian's).
  get_filename_component(_winnow_torch_root "${_winnow_torch_prefix}/../.." ABSOLUTE)
  list(PREPEND CMAKE_PREFIX_PATH "${_winnow_torch_root}" "${_winnow_torch_prefix}")
  message(STATUS "winnow package: building against torch ${WINNOW_PACKAGE_TORCH_VERSION} "
                 "(${_winnow_torch_prefix}), CUDA '${_winnow_torch_cuda}'")
  if(_winnow_torch_cuda STREQUAL "")
    set(WINNOW_CUDA OFF CACHE STRING "" FORCE)
  elseif(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    if(DEFINED ENV{WINNOW_CUDA_ARCHITECTURES})
      set(CMAKE_CUDA_ARCHITECTURES "$ENV{WINNOW_CUDA_ARCHITECTURES}")
    elseif(NOT _winnow_gpu_arch STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES "${_winnow_gpu_arch}")
    endif()
  endif()
else()
  # pip's build isolation hides the installed torch from the build: fall back to a LibTorch
  # in the default places (Debian's libtorch-dev, whose torch is Debian's python3-torch).
  message(STATUS "winnow package: ${_winnow_python} cannot import torch (pip's build isolation?); "
                 "looking for LibTorch in the default places, without CUDA kernels. With a pip "
                 "torch, install with: pip install --no-build-isolation .")
  set(WINNOW_CUDA OFF CACHE STRING "" FORCE)
endif()
