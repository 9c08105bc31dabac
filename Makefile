PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev,lora]'
	touch $(STAMP)

install: $(STAMP)

# Warm-start the tiny model (supervised, separate from RL), then run the async RL job.
demo: $(STAMP)
	$(BIN)/python -m examples.arithmetic.warmstart --out .cache/arithmetic-warmstart
	$(BIN)/loomrl run examples/arithmetic/job.toml

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples

clean:
	rm -rf $(VENV) runs .cache
