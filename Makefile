# keye: the two commands a fresh machine needs.
#   make test   create .venv if missing, install torch + keye with every extra, run the test suite
#   make demo   start the Gradio video Q&A demo on the embedded keye-tiny model
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.14.1 torchvision==0.29.1
EXTRAS  := test,video,train,data,demo,eval,serve
PYTEST_ARGS ?=

.PHONY: install test test-fast lint bench clean demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/ruff check keye tests benchmarks training eval demo data
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: install
	$(BIN)/keye demo --model keye-tiny

lint: install
	$(BIN)/ruff check keye tests benchmarks training eval demo data

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
