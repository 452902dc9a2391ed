# The quick start: `make serve` runs the main job, `make test` runs the tests. Both build .venv first.
# `make eval` checks the server with lm-evaluation-harness (in its own .venv-eval): EVAL_LIMIT=N examples per
# task, SERVE_ARGS='--model DIR ...' for `ds4 serve` (default: the built-in tiny model).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ds4-installed

# No CUDA here: the CPU build of torch (on machines with a GPU pip picks the CUDA build of torch>=2.11).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.11' || echo 'torch==2.13.0')

EVAL_VENV := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.lm-eval-installed
LM_EVAL_SPEC := lm-eval[api]==0.4.13
EVAL_LIMIT ?=
SERVE_ARGS ?=

.PHONY: venv serve test lint format eval clean

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

$(EVAL_STAMP):
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install -q '$(LM_EVAL_SPEC)'
	touch $(EVAL_STAMP)

eval: venv $(EVAL_STAMP)
	DS4=$(BIN)/ds4 LM_EVAL=$(EVAL_VENV)/bin/lm_eval EVAL_LIMIT='$(EVAL_LIMIT)' DS4_SERVE_ARGS='$(SERVE_ARGS)' \
		bash tools/lm_eval.sh

clean:
	rm -rf $(VENV) $(EVAL_VENV)
