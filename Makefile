# Two commands on a fresh machine:
#   make train   install into .venv and run the embedded default training (CPU smoke run on bundled data)
#   make test    install into .venv and run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test test-fast clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# NOTE: the CPU build of torch first; an unpinned torch would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# NOTE: every optional extra (parquet: pyarrow) as well, so that the tests of what it enables run too.
	$(BIN)/pip install -q -e '.[dev,parquet]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m titan_k3.train

test: $(STAMP)
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) runs
