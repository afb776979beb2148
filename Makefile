# Two commands do all set-up: `make demo` and `make test`. Both create .venv if it is missing.
# TORCH_SPEC picks the torch build: the default is the CPU build; on a GPU machine use e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.tuner-installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install browser demo test test-fast lint format docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -c "import torch; print('torch', torch.__version__)" > $(VENV)/.torch-pin
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tuner.demo --out demo_out

# The browser tests of `tuner ui` drive Debian's chromium (playwright's own browser download needs the
# internet): installed with apt when it is missing and apt is there (CI runs as root).
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The tests run in a random order (pytest-randomly), a new one each time: every test must pass alone and
# after any other. The seed is printed; `make test SEED=N` (or pytest's `-p randomly --randomly-seed=N`)
# repeats that order. Tests are spread over the processes in groups (a file, or one architecture's tests of
# the contract fixture), the costliest first (tests/scheduling.py); `python benchmarks/test_time.py` shows
# where the time goes.
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')

test: $(STAMP) browser
	$(BIN)/python -m ruff check src tests scripts benchmarks
	$(BIN)/python -m ruff format --check src tests scripts benchmarks
	@echo "test order: --randomly-seed=$(SEED) (make test SEED=$(SEED) repeats it)"
	$(BIN)/python -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder -p randomly --randomly-seed=$(SEED) tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder -m "not slow" tests

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests scripts benchmarks
	$(BIN)/python -m ruff format --check src tests scripts benchmarks

format: $(STAMP)
	$(BIN)/python -m ruff format src tests scripts benchmarks
	$(BIN)/python -m ruff check --fix src tests scripts benchmarks

# What is generated from the code: the config reference and the record-dependent parts of the README and
# docs/architectures.md (tests fail while either is stale).
docs: $(STAMP)
	$(BIN)/python -m tuner.config.docs > docs/config.md
	$(BIN)/python -m tuner.archs.docs --write

clean:
	rm -rf demo_out .pytest_cache .ruff_cache
