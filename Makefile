# make install | test | demo | lint. Everything runs inside .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo lint

install: $(STAMP)

# torch goes in first and on its own: `torch==2.13.0` takes a local CPU build where the
# machine offers one, whereas letting the resolver pick would pull a multi-GB CUDA build. An
# existing torch is left alone.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[export,rtx,serve,dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest

demo: install
	test -d demo/tiny-qwen3-vl || $(BIN)/python scripts/make_tiny_checkpoint.py demo/tiny-qwen3-vl
	$(BIN)/qvl-trt plan --model demo/tiny-qwen3-vl --gpu 4090d

lint: install
	$(BIN)/ruff check qvl_trt tests scripts
