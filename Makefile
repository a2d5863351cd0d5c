# Two commands on a fresh machine:  `make demo` (train the embedded demo) and `make test` (the test suite).
# Both create .venv on first use. Without an NVIDIA GPU the CPU build of torch is installed first, so pip never
# pulls the multi-GB CUDA build (TORCH_PIP_ARGS can name an index that serves CPU wheels).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

$(BIN)/raysft: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet torch; \
	else \
		$(BIN)/pip install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS); \
	fi
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

.PHONY: demo test test-fast
demo: $(BIN)/raysft
	$(BIN)/raysft train jobs/configs/demo.yaml --export runs/demo-model --prompt "What is the capital of France?"

# Two pytest processes, each taking whole test files (--dist loadfile: a module's cluster, runs and fixtures stay in
# one process): much of the suite waits on Ray, process starts and faults rather than computing, so two overlap on
# 2 cores. TEST_PROCESSES=0 runs it in this one process.
TEST_PROCESSES ?= 2
test: $(BIN)/raysft
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# For a developer's loop: no Ray, no fault scenarios, no benchmark harnesses (tests marked slow). CI runs `make test`.
test-fast: $(BIN)/raysft
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)
