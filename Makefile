# The two commands of the README, and the steps they are made of.
#   make demo   build, then run the main job
#   make test   build, then run every CPU test (C++ and Python)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

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

demo: build
	$(BUILD)/apps/winnow demo

bench-cpu: build
	@tools/install-deps.sh bench
	$(BUILD)/bench/cpu_attention_bench

clean:
	rm -rf $(BUILD)
