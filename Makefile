# The two commands of the README, and the steps they are made of.
#   make demo   build the tool, then run the main job: the MQRAR length-extrapolation study
#               (studies/mqrar.json: its CPU profile here, its larger CUDA profile on a machine
#               whose python3 has a CUDA build of PyTorch, which the tool is then built against)
#   make test   build, then run every CPU test (C++ and Python), then `pip install .` into a
#               fresh environment and the Python tests against that installed package
#   make corpus the language-modeling corpus in data/corpus (Debian's linux-doc, installed if
#               missing, through tools/prepare_corpus.py)
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
# A CUDA PyTorch makes the demo a GPU run: its LibTorch, its own build folder.
CUDA_TORCH := $(shell python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 && echo yes)
ifeq ($(CUDA_TORCH),yes)
BUILD ?= build-gpu
# Kernels for this GPU only (Hopper needs its architecture-specific sm_90a).
GPU_ARCH := $(shell python3 -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}a" if m == 9 else f"{m}{n}")')
DEMO_CMAKE_ARGS := -DCMAKE_PREFIX_PATH=$(shell python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') -DWINNOW_TORCH=ON -DCMAKE_CUDA_ARCHITECTURES=$(GPU_ARCH)
else
BUILD ?= build
DEMO_CMAKE_ARGS :=
endif
# A machine that cannot install packages builds with the copies tools/prepare_gpu_deps.sh made.
ifneq ($(wildcard .gpudeps),)
DEMO_DEPS :=
DEMO_CMAKE_ARGS += -DWINNOW_DEPS_DIR=$(CURDIR)/.gpudeps
else
DEMO_DEPS := deps
endif

.PHONY: all deps configure build test demo bench-cpu corpus clean

all: build

deps:
	@tools/install-deps.sh

# Where ccache is installed (tools/install-deps.sh installs it), the library's C++ files go through
# build/ccache, which `pip install .` in tools/check_pip_install.sh then reads (CMakeLists.txt).
configure: deps
	cmake --preset default -B $(BUILD) $$(command -v ccache >/dev/null && echo -DWINNOW_CCACHE_DIR=$(CURDIR)/build/ccache) $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# ctest runs $(JOBS) tests at once, so each gets its share of the cores for LibTorch's and
# OpenMP's threads: two toy trainings side by side on 2 cores took 37 s at 2 threads each, 24 s
# at one. (Tests of the kernels' threading set their thread counts themselves.)
TEST_THREADS ?= $(shell n=$$(nproc); t=$$(( n / $(JOBS) )); echo $$(( t > 0 ? t : 1 )))

test: build
	OMP_NUM_THREADS=$(TEST_THREADS) ctest --test-dir $(BUILD) -L cpu --output-on-failure -j $(JOBS)
	tools/check_pip_install.sh

# Only the tool and what it links: the tests are not needed to run the study.
demo: $(DEMO_DEPS)
	cmake --preset default -B $(BUILD) $(DEMO_CMAKE_ARGS) $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS) --target winnow_cli
	$(BUILD)/apps/winnow study studies/mqrar.json

bench-cpu: configure
	@tools/install-deps.sh bench
	cmake --build $(BUILD) -j $(JOBS) --target cpu_attention_bench
	$(BUILD)/bench/cpu_attention_bench

corpus:
	@tools/install-deps.sh corpus
	python3 tools/prepare_corpus.py --out data/corpus

clean:
	rm -rf $(BUILD)
