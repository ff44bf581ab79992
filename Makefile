# The two entry points: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := .ci/constraints.txt

.PHONY: demo test test-all test-rounding bench bench-check docs install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test,bench,fast,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pyro_convexvb demo

# one pytest worker per core (pytest-xdist); the torchrun cases of tests/distributed stay on one worker
test: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest -q -n auto --dist loadgroup

test-all: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest -q -n auto --dist loadgroup -m ''

# the suite on one core with other kernels (SSE instead of AVX2 in MKL and ATen): other rounding, as on other CPUs;
# a test whose tolerance is tighter than its algorithm's fails here
test-rounding: $(STAMP)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default MPLBACKEND=Agg taskset -c 0 $(BIN)/python -m pytest -q

bench: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pyro_convexvb bench

bench-check: $(STAMP)
	$(BIN)/python benchmarks/check.py

docs: $(STAMP)
	$(BIN)/python -m sphinx -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build
