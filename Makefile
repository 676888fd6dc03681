# Two commands on a fresh machine:
#   make train   install into .venv and run the embedded default training (a smoke run on bundled data; on a GPU if torch sees one)
#   make test    install into .venv and run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# NOTE: the pinned torch first, so the editable install below does not resolve another. Which build it is
	# comes from pip's index: PyPI's Linux wheel is the CUDA build; a CPU-only machine can point pip at
	# PyTorch's CPU index (PIP_INDEX_URL=https://download.pytorch.org/whl/cpu) to skip the CUDA libraries.
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
