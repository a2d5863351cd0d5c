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

test: $(BIN)/raysft
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# For a developer's loop: no Ray, no fault scenarios, no benchmark harnesses, no long training runs (tests marked
# slow). CI runs `make test`.
test-fast: $(BIN)/raysft
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)
