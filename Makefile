# Two commands on a fresh machine:  `make demo` (train the embedded demo) and `make test` (the test suite).
# Both create .venv on first use. Without an NVIDIA GPU the CPU build of torch is installed first, so pip never
# pulls the multi-GB CUDA build (TORCH_PIP_ARGS can name an index that serves CPU wheels). `make demo` installs
# raysft alone; `make test` adds the test extras (pyproject's `test`: trl, mlflow, wandb, moto, pytest...) to the
# same .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TEST_EXTRAS := $(VENV)/.test-extras

# The base install (what `make demo` needs): the venv, torch, raysft and its dependencies.
$(BIN)/raysft: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet torch; \
	else \
		$(BIN)/pip install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS); \
	fi
	$(BIN)/pip install --quiet -e .
	@touch $@

# Exits 0 when every requirement of pyproject's `test` extra (and of raysft's own extras it names) is installed at
# a version pyproject allows. Then pip is not run: a venv that has them (one made before this stamp existed, or
# by `make -o .venv/bin/raysft test`) is checked, not reinstalled, and needs no network.
define HAS_TEST_EXTRAS
import importlib.metadata, tomllib
from packaging.requirements import Requirement
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
todo, seen = ["test"], set()
while todo:
    extra = todo.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for text in extras[extra]:
        req = Requirement(text)
        if req.name == "raysft":
            todo += sorted(req.extras)
        elif not req.marker or req.marker.evaluate():
            if not req.specifier.contains(importlib.metadata.version(req.name), prereleases=True):
                raise SystemExit(f"{req.name} {importlib.metadata.version(req.name)} is not {req}")
endef
export HAS_TEST_EXTRAS

# The test extras over the base install, in the same venv.
$(TEST_EXTRAS): $(BIN)/raysft pyproject.toml
	@$(BIN)/python -I -c "$$HAS_TEST_EXTRAS" 2>/dev/null || $(BIN)/pip install --quiet -e '.[test]'
	@touch $@

.PHONY: demo test test-fast
demo: $(BIN)/raysft
	$(BIN)/raysft train jobs/configs/demo.yaml --export runs/demo-model --prompt "What is the capital of France?"

# Two pytest processes side by side (pytest-xdist): the tests that start Ray in one, the rest in the other
# (tests/conftest.py's streams; a Ray test waits on Ray's processes for much of its time).
test: $(TEST_EXTRAS)
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# For a developer's loop: no Ray, no fault scenarios, no benchmark harnesses, no long training runs (tests marked
# slow). CI runs `make test`.
test-fast: $(TEST_EXTRAS)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)
