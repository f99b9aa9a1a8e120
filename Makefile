# pdserve: `make demo` and `make test` work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch is pinned first so the project install does not pull CUDA wheels.
TORCH_PIN ?= torch==2.13.0
# The rest installs with uv, compiled to bytecode as pip does (a fresh install in ~40 s
# against ~110 s with pip here); pip does it where uv cannot (e.g. an index only pip's
# configuration names).
# Packages `make typecheck` checks (a prefix keeps a package and its subpackages).
TYPED ?= pdserve

.PHONY: demo test test-fast readme config-docs lint typecheck pytest fuzz gpu-check soak venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN) uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[test]' \
		|| $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pdserve demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy checks every module of the package map in pyproject.toml under its import
# name (tests/typecheck.py), with the [tool.mypy] settings there.
typecheck: $(STAMP)
	$(BIN)/python -m tests.typecheck $(TYPED)

pytest: $(STAMP)
	$(BIN)/python -m tests.lanes -q --durations=25

# mypy runs at the head of pytest's second lane (tests/lanes.py), beside the first.
test: lint
	$(BIN)/python -m tests.lanes --typecheck $(TYPED) -q --durations=25

# The inner loop between commits: every test that starts no Ray and no cluster (unit,
# engine, router, transfer, sim; README's examples left out), a pytest worker per core
# (each with one torch thread), stopping at the first failure.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not cluster and not readme" -q -x -n auto --durations=10

# Every example of README.md and the docs pages a user can run here, the long ones too
# (tests/test_readme.py).
readme: $(STAMP)
	PDSERVE_README_LONG=1 $(BIN)/python -m pytest -m readme -q --durations=0

# docs/config.md, the configuration reference, from the config dataclasses' docstrings
# (tests/cluster/test_config_docs.py fails when the page is stale).
config-docs: $(STAMP)
	$(BIN)/python -m pdserve.deploy.config_docs > docs/config.md

# The fuzzers of `make test` (front door, profile files), longer: EXAMPLES examples per fuzzer.
EXAMPLES ?= 2000
fuzz: $(STAMP)
	PDSERVE_FUZZ_EXAMPLES=$(EXAMPLES) $(BIN)/python -m pytest -q tests/e2e/test_hostile.py tests/sim/test_profile_values.py -k fuzz

# Everything GPU-related on a bare GPU machine (torch, triton, msgpack, grpcio; no Ray,
# no network, no install): CUDA tests, native Triton kernels, GPU benchmarks.
GPU_OUT ?= gpu-results
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(GPU_OUT)

# A local cluster at 80% of its capacity for MINUTES, with client cancels and a worker
# killed every minute (bench/soak.py); its figures go in docs/results/serving.md
# (the headline in bench/RESULTS.md).
MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/pdserve bench soak --minutes $(MINUTES)

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
