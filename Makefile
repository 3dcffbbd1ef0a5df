# keye: the two commands a fresh machine needs.
#   make test   create .venv if missing, install torch + keye with every extra, run the test suite
#   make demo   start the Gradio video Q&A demo on the embedded keye-tiny model (PORT=7861 for another port)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.14.1 torchvision==0.29.1
EXTRAS  := test,video,train,data,demo,eval,serve,ray
PYTEST_ARGS ?=

.PHONY: install test test-fast lint bench clean demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

# Stock Pillow 13.0 in a side folder off the venv's import path (gradio pins pillow<13), for
# tests/processing/test_resample_pillow13.py, which checks keye's resampler against it bit for bit.
$(VENV)/.pillow13: | $(BIN)/python
	$(BIN)/pip install -q --upgrade --no-warn-conflicts --target $(VENV)/pillow13 pillow==13.0.0
	touch $@

install: $(VENV)/.installed $(VENV)/.pillow13

test: install
	$(BIN)/ruff check keye tests benchmarks training eval demo data
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# make demo PORT=7861: the demo on another port (an error naming the port when it is in use)
demo: install
	$(BIN)/keye demo --model keye-tiny --port $(or $(PORT),7860)

lint: install
	$(BIN)/ruff check keye tests benchmarks training eval demo data

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
