# Developer entry points. `make run` starts the local stack; `make test` runs lint and the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/turnbus up $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/bench_*.py; do echo "== $$b"; PYTHONPATH=. $(BIN)/python $$b || exit 1; done
	PYTHONPATH=. $(BIN)/python benchmarks/report.py --write

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
