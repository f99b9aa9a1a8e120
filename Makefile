# pdserve: `make demo` and `make test` work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch is pinned first so the project install does not pull CUDA wheels.
TORCH_PIN ?= torch==2.13.0
TYPED := core engine transfer router

.PHONY: demo test lint typecheck pytest fuzz gpu-check venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pdserve demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy resolves `pdserve.<part>` through a tree of links that mirrors the
# package mapping in pyproject.toml.
typecheck: $(STAMP)
	@rm -rf build/typecheck && mkdir -p build/typecheck/pdserve
	@for d in core engine parallel prefill decode transfer router cluster deploy bench; do \
		ln -s ../../../$$d build/typecheck/pdserve/$$d; done
	@ln -s ../../../api/__init__.py build/typecheck/pdserve/__init__.py
	@ln -s ../../../api/llm.py build/typecheck/pdserve/llm.py
	cd build/typecheck && ../../$(BIN)/mypy $(foreach p,$(TYPED),-p pdserve.$(p))

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

# The front-door fuzzers of `make test`, longer: EXAMPLES generated requests per fuzzer.
EXAMPLES ?= 2000
fuzz: $(STAMP)
	PDSERVE_FUZZ_EXAMPLES=$(EXAMPLES) $(BIN)/python -m pytest -q tests/e2e/test_hostile.py -k fuzz

# Everything GPU-related on a bare GPU machine (torch, triton, msgpack, grpcio; no Ray,
# no network, no install): CUDA tests, native Triton kernels, GPU benchmarks.
GPU_OUT ?= gpu-results
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(GPU_OUT)

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
