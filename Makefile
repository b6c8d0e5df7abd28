# Two entry points (README quick start): `make run` and `make test`. Each creates the virtual
# environment on first use, so either works on a fresh machine with Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.starfed-installed

# Flower/Ray settings for local runs and tests: no telemetry, no update checks, no per-run
# dependency installs, state under the run's own directory.
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: run test test-all lint typecheck pyproject bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)  ## the default job: a federated simulation on the bundled data
	$(BIN)/starfed simulate

# The fast suite in TEST_WORKERS pytest-xdist workers (0: serially). `--dist loadgroup` with the
# groups of tests/conftest.py (its scheduler: xdist's own reads no group under pytest 9): the
# modules that start a SuperLink on one worker, one after another (two deployments side by side
# on 2 cores missed their start-up deadlines), each other module whole on a worker (its module
# fixtures built once), handed out in the order tests/conftest.py gives them
# (`--no-loadscope-reorder`: xdist would sort the groups by their count of tests): those
# modules first, then the longest tiers first. 2 workers: 529 s against 794 s serially
# (docs/benchmarks.md#the-test-suites-cost).
TEST_WORKERS ?= 2
test: $(STAMP)  ## lint + format + types + the fast suite (what CI runs)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test-all: $(STAMP)  ## every test, including the long ones
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	$(BIN)/python -m starfed.shared.pyproject_table --write-pyproject pyproject.toml --check

# mypy cannot follow the editable install (pyproject.toml's package-dir renames the folders), so
# it reads them as `starfed.*` through a folder of links; settings in pyproject.toml [tool.mypy].
MYPY_LINKS := .cache/mypy/starfed
PACKAGES   := cli client server shared simulations proto host ops
typecheck: $(STAMP)  ## mypy: strict on shared/, untyped bodies checked elsewhere
	mkdir -p $(MYPY_LINKS)
	for folder in $(PACKAGES); do ln -sfn ../../../$$folder $(MYPY_LINKS)/$$folder; done
	$(BIN)/mypy $(addprefix -p starfed.,$(PACKAGES))

pyproject: $(STAMP)  ## write pyproject.toml's [tool.flwr.app.config] from the knob table
	$(BIN)/python -m starfed.shared.pyproject_table --write-pyproject pyproject.toml

bench: $(STAMP)  ## speed benchmarks (logs in bench/results/, summary in docs/benchmarks.md)
	$(BIN)/python bench/train_local.py
	$(BIN)/python bench/codebook_sizes.py

clean:
	rm -rf $(VENV) .cache results .pytest_cache .ruff_cache
