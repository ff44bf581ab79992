# The two entry points: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := .ci/constraints.txt

.PHONY: demo test test-all bench bench-check docs install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test,bench,fast,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pyro_convexvb demo

test: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest -q

test-all: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pytest -q -m ''

bench: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python -m pyro_convexvb bench

bench-check: $(STAMP)
	$(BIN)/python benchmarks/check.py

docs: $(STAMP)
	$(BIN)/python -m sphinx -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build
