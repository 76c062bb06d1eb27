# The two commands of the README. Both set up (packages, corpus), configure, build incrementally,
# then do their job.
BUILD_DIR ?= build
JOBS ?= 2
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
RUN_DIR ?= runs/demo
# The demo's CPU memory cap: a multiple of the static memory (weights, gradients, AdamW state),
# small enough that long outer batches must be split into several microbatches.
DEMO_CAP_FACTOR ?= 2.0

.PHONY: demo test setup build configure clean

# The demo builds only what it runs; `make test` builds everything.
demo: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target xpm-train
	$(BUILD_DIR)/bin/xpm-train --run-dir $(RUN_DIR) --memory-cap-factor $(DEMO_CAP_FACTOR)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

setup:
	tools/setup.sh

$(BUILD_DIR)/CMakeCache.txt: | setup
	cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS)

configure: $(BUILD_DIR)/CMakeCache.txt

build: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

clean:
	rm -rf $(BUILD_DIR)
