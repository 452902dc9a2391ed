# The quick start: `make serve` runs the main job, `make test` runs the tests. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ds4-installed

# No CUDA here: the CPU build of torch (on machines with a GPU pip picks the CUDA build of torch>=2.11).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.11' || echo 'torch==2.13.0')

.PHONY: venv serve test lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q '$(TORCH_SPEC)' 'triton==3.6.0'
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

serve: venv
	$(BIN)/ds4 serve

test: venv
	$(BIN)/python -m pytest tests

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV)
