# Developer entry points. `make run` starts the local stack; `make test` runs lint and the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint typecheck-tree generate bench install clean

$(BIN)/python:
	@echo "make: creating a virtualenv in $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: upgrading pip in $(VENV)"
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "make: installing turnbus and its dependencies into $(VENV) (a minute or two the first time; quiet until done)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@
	@echo "make: installed; $(BIN)/turnbus is ready"

install: $(VENV)/.installed

run: install
	@echo "make: starting the stack: $(BIN)/turnbus up $(ARGS)  (Redis, a gateway, two workers; Ctrl-C stops it)"
	$(BIN)/turnbus up $(ARGS)

# mypy cannot follow setuptools' package-dir mapping (turnbus.shared is ./shared, and so
# on), so it reads the turnbus package from a tree of links to the same files.
TYPECHECK := build/typecheck/turnbus
typecheck-tree:
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	@for f in services/cli/turnbus/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK)/; done
	@ln -s "$(CURDIR)/shared" $(TYPECHECK)/shared
	@ln -s "$(CURDIR)/services/gateway" $(TYPECHECK)/gateway
	@ln -s "$(CURDIR)/services/worker" $(TYPECHECK)/worker

lint: install typecheck-tree
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The files generated from turnbus.shared.contracts (each checked against it by a test):
# the Lua scripts' statuses, reasons and event fields, and the console's statuses.
generate: install
	$(BIN)/python -m turnbus.shared.generate

# The suite runs on PYTEST_WORKERS processes (pytest-xdist); PYTEST_WORKERS=0 runs it in
# this one process. Three on a 2-core machine: most tests wait on the processes they
# start, on timers and on sockets, so a third process keeps both cores busy.
PYTEST_WORKERS ?= 3
test: lint
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/bench_*.py; do echo "== $$b"; PYTHONPATH=. $(BIN)/python $$b || exit 1; done
	PYTHONPATH=. $(BIN)/python benchmarks/bench_load.py --cluster
	PYTHONPATH=. $(BIN)/python benchmarks/bench_load.py --replica
	PYTHONPATH=. $(BIN)/python benchmarks/report.py --write

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
