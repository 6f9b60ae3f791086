# Two commands do all set-up from a fresh clone:  make run  |  make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# pip must take the CPU wheel of torch that lies on this machine's disk: pin it exactly, first. This is
# the release CI tests; pyproject.toml accepts any release in the range the code supports.
TORCH := torch==2.13.0

.PHONY: run test lint bench bench-flower clean
# Flower lives in a venv of its own (its pins are not vatra's): only the side-by-side benchmark uses it.
FLOWER_VENV := .venv-flower

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[all]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(BIN)/vatra train examples/digits.toml

test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	@# bytecode once: every process a test starts imports vatra, and with PYTHONDONTWRITEBYTECODE each
	@# would compile it from source again
	$(BIN)/python -m compileall -q -j 0 src tests
	$(BIN)/python -m pytest -q -n 4 --dist loadgroup --durations=20

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/sharding_variance.py
	$(BIN)/python bench/input_pipeline.py

$(FLOWER_VENV)/.installed:
	$(PYTHON) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/pip install -q $(TORCH)
	$(FLOWER_VENV)/bin/pip install -q 'flwr[simulation]' numpy
	touch $@

bench-flower: $(VENV)/.installed-dev $(FLOWER_VENV)/.installed
	$(BIN)/python bench/fl_vs_flower.py --flower-python $(FLOWER_VENV)/bin/python
	$(BIN)/python bench/fl_vs_flower.py --flower-python $(FLOWER_VENV)/bin/python --clients 1000 --per-round 100 --same-clients --seeds 0

clean:
	rm -rf $(VENV) $(FLOWER_VENV) runs bench/results
