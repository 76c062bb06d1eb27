# The two commands of the README. Both set up (packages, the Python environment with torch,
# corpus), configure, build incrementally, then do their job.
BUILD_DIR ?= build
# The Python environment whose PyTorch 2.x is xpm's LibTorch: .venv/ (made by tools/setup.sh),
# or XPM_PYTHON=/path/to/python to reuse an environment that has torch 2.11 to 2.14.
XPM_PYTHON ?=
export XPM_PYTHON
PYTHON := $(if $(XPM_PYTHON),$(XPM_PYTHON),$(CURDIR)/.venv/bin/python)
SETUP_FLAGS ?=
JOBS ?= 2
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
RUN_DIR ?= runs/demo
# The demo's CPU memory cap: a multiple of the static memory (weights, gradients, AdamW state),
# small enough that long outer batches must be split into several microbatches.
DEMO_CAP_FACTOR ?= 2.0

.PHONY: demo test setup build configure clean wheel

# The demo builds only what it runs; `make test` builds everything.
# The demo's device: the GPU where the environment's torch sees one, else the CPU.
DEMO_DEVICE ?= $(shell $(PYTHON) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
demo: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target xpm-train
	$(BUILD_DIR)/bin/xpm-train --run-dir $(RUN_DIR) --memory-cap-factor $(DEMO_CAP_FACTOR) --device $(DEMO_DEVICE)

# The tests also need the integrations' packages (transformers, lightning, accelerate, torchdata)
# and a CUDA build of torch for the CUDA build check (tools/setup.sh --test).
test: SETUP_FLAGS = --test
test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

setup:
	tools/setup.sh $(SETUP_FLAGS)

$(BUILD_DIR)/CMakeCache.txt: | setup
	cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS) -DXPM_PYTHON_EXECUTABLE=$(PYTHON)

configure: $(BUILD_DIR)/CMakeCache.txt

build: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

clean:
	rm -rf $(BUILD_DIR)

# A manylinux wheel of the Python package in dist/, its libraries inside it (tools/make_wheel.sh):
# pip install dist/xpm-*.whl next to the same torch, without a compiler or Debian's libraries.
wheel: setup
	tools/make_wheel.sh $(PYTHON) dist '$(BUILD_DIR)/pip/{wheel_tag}'

# `make bench` regenerates every table and figure of docs/benchmarks.md (the sections between
# bench-report markers, docs/figures/bench-*.svg): packers and fit (Google Benchmark), held-out
# prediction of both bundled models, the end-to-end batcher comparison (bench/*.cpp say what
# each measures), and Python's predictive batching against a fixed microbatch and a hand-set token
# budget (bench/python_batching_throughput.py), and the HF Trainer drop-in against what its users
# do today (bench/hf_dropin_throughput.py); the order of a step's microbatches on the emulated
# caching allocator (bench/allocator_order.py: printed to $(BENCH_DIR), its table in
# docs/benchmarks.md written by hand); what setting the sampler's position costs per step
# (bench/sampler_resume_cost.py, likewise); plans of reserved bytes with tensors of tens of MB
# (bench/reserved_planning_scale.py, likewise). Raw outputs go to $(BENCH_DIR). About 23 minutes on the
# 2-core machine.
BENCH_DIR ?= runs/bench
BENCH_STEPS ?= 150
BENCH_MIN_TIME ?= 0.2
BENCH_THREADS ?= 2
BENCH_PRECISION_STEPS ?= 20
# Per-rank CPU cap of the sharding table: 2 x the default model's unsharded static bytes.
BENCH_SHARDING_CAP_BYTES ?= 98181216

.PHONY: bench
bench: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target packer_bench fit_bench heldout-prediction \
	  batcher-comparison bench-report
	mkdir -p $(BENCH_DIR)
	$(BUILD_DIR)/bin/packer_bench --benchmark_min_time=$(BENCH_MIN_TIME) \
	  --benchmark_out=$(BENCH_DIR)/packers.json --benchmark_out_format=json
	$(BUILD_DIR)/bin/fit_bench --benchmark_min_time=$(BENCH_MIN_TIME) \
	  --benchmark_out=$(BENCH_DIR)/fit.json --benchmark_out_format=json
	$(BUILD_DIR)/bin/heldout-prediction --architecture transformer --threads $(BENCH_THREADS) \
	  --json $(BENCH_DIR)/heldout-transformer.json
	$(BUILD_DIR)/bin/heldout-prediction --architecture bilstm --threads $(BENCH_THREADS) \
	  --json $(BENCH_DIR)/heldout-bilstm.json
	$(BUILD_DIR)/bin/batcher-comparison --steps $(BENCH_STEPS) --threads $(BENCH_THREADS) \
	  --work-dir $(BENCH_DIR)/batchers --json $(BENCH_DIR)/batchers.json
	$(BUILD_DIR)/bin/bench-report --packers $(BENCH_DIR)/packers.json --fit $(BENCH_DIR)/fit.json \
	  --heldout $(BENCH_DIR)/heldout-transformer.json --heldout $(BENCH_DIR)/heldout-bilstm.json \
	  --batchers $(BENCH_DIR)/batchers.json --docs docs/benchmarks.md --figures docs/figures \
	  --machine "$$(nproc) cores, $$(awk '/MemTotal/ {printf "%.0f GiB", $$2/1048576}' /proc/meminfo), load average at the end $$(cut -d' ' -f1-3 /proc/loadavg)" \
	  --command "make bench"
	bench/precision_modes.sh $(BUILD_DIR) $(BENCH_DIR)/precision $(BENCH_PRECISION_STEPS) $(BENCH_THREADS) \
	  > $(BENCH_DIR)/precision-modes.md
	bench/splice_section.sh precision-modes $(BENCH_DIR)/precision-modes.md docs/benchmarks.md \
	  "make bench (bench/precision_modes.sh, $(BENCH_PRECISION_STEPS) steps per mode)"
	bench/sharding_modes.sh $(BUILD_DIR) $(BENCH_DIR)/sharding $(BENCH_PRECISION_STEPS) 1 \
	  $(BENCH_SHARDING_CAP_BYTES) > $(BENCH_DIR)/sharding-modes.md
	bench/splice_section.sh sharding-modes $(BENCH_DIR)/sharding-modes.md docs/benchmarks.md \
	  "make bench (bench/sharding_modes.sh, $(BENCH_PRECISION_STEPS) steps per mode, 1 thread per rank)"
	cmake --build $(BUILD_DIR) -j $(JOBS) --target xpm_python_planner xpm_python_torch
	PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/python_batching_throughput.py \
	  --data-dir data/brown --records 1024 --json $(BENCH_DIR)/python-batching.json > $(BENCH_DIR)/python-batching.md
	bench/splice_section.sh python-batching $(BENCH_DIR)/python-batching.md docs/benchmarks.md \
	  "make bench (bench/python_batching_throughput.py, 1,024 Brown sentences, 1 thread)"
	PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/hf_dropin_throughput.py \
	  --data-dir data/brown --records 4096 --json $(BENCH_DIR)/hf-dropin.json > $(BENCH_DIR)/hf-dropin.md
	bench/splice_section.sh hf-dropin $(BENCH_DIR)/hf-dropin.md docs/benchmarks.md \
	  "make bench (bench/hf_dropin_throughput.py, 4,096 Brown sentences, 1 thread)"
	PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/allocator_order.py \
	  --json $(BENCH_DIR)/allocator-order.json > $(BENCH_DIR)/allocator-order.txt
	PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/allocator_order.py --expandable-segments \
	  --json $(BENCH_DIR)/allocator-order-expandable.json > $(BENCH_DIR)/allocator-order-expandable.txt
	PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/sampler_resume_cost.py \
	  > $(BENCH_DIR)/sampler-resume-cost.txt
	for segments in "" --expandable-segments; do \
	  PYTHONPATH=$(BUILD_DIR)/python OMP_NUM_THREADS=1 $(PYTHON) bench/reserved_planning_scale.py $$segments \
	    --json $(BENCH_DIR)/reserved-planning-scale$$segments.json > $(BENCH_DIR)/reserved-planning-scale$$segments.txt \
	    || exit 1; \
	done
