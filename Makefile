# The two commands of the README, and the steps they are made of.
#   make demo   build the tool, then run the main job: the MQRAR length-extrapolation study
#               (studies/mqrar.json: its CPU profile here, its larger CUDA profile on a machine
#               whose python3 has a CUDA build of PyTorch, which the tool is then built against)
#   make test   build, then run every CPU test (C++ and Python)
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
# A CUDA PyTorch makes the demo a GPU run: its LibTorch, its own build folder.
CUDA_TORCH := $(shell python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 && echo yes)
ifeq ($(CUDA_TORCH),yes)
BUILD ?= build-gpu
DEMO_CMAKE_ARGS := -DCMAKE_PREFIX_PATH=$(shell python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') -DWINNOW_TORCH=ON
else
BUILD ?= build
DEMO_CMAKE_ARGS :=
endif

.PHONY: all deps configure build test demo bench-cpu clean

all: build

deps:
	@tools/install-deps.sh

configure: deps
	cmake --preset default -B $(BUILD) $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) -L cpu --output-on-failure -j $(JOBS)

# Only the tool and what it links: the tests are not needed to run the study.
demo: deps
	cmake --preset default -B $(BUILD) $(DEMO_CMAKE_ARGS) $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS) --target winnow_cli
	$(BUILD)/apps/winnow study studies/mqrar.json

bench-cpu: build
	@tools/install-deps.sh bench
	$(BUILD)/bench/cpu_attention_bench

clean:
	rm -rf $(BUILD)
