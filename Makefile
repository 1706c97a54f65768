# make install | test | demo | lint. Everything runs inside .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo lint browser prometheus

install: $(STAMP)

# torch goes in first and on its own: `torch==2.13.0` takes a local CPU build where the
# machine offers one, whereas letting the resolver pick would pull a multi-GB CUDA build. An
# existing torch is left alone.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[export,rtx,serve,gateway,dev]"
	touch $(STAMP)

# Tests run on one worker per core, two to four: much of a test's time is a server's
# processes starting or answering, so a second worker on two cores cuts the run by about a
# third. A module runs whole on one worker, so its module-scoped servers start once.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, max(2, os.cpu_count() or 1)))")

test: install browser prometheus
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope

# Chromium + chromium-driver for the chat page's browser test (tests/test_gateway_page.py),
# where apt-get runs as root (CI); elsewhere the script says why that test will skip.
browser:
	bash scripts/install_debian_packages.sh "the chat page's browser test" \
	  "chromium chromedriver" chromium chromium-driver fonts-dejavu-core

# Prometheus and promtool (Debian's prometheus, bookworm: 2.42) for the monitoring tests
# (promtool check/test rules on what `deploy --monitoring` writes) and
# scripts/render_dashboard.py, where apt-get runs as root (CI); elsewhere the script says why.
prometheus:
	bash scripts/install_debian_packages.sh "the monitoring tests" "promtool prometheus" \
	  prometheus

# The main job on a tiny random checkpoint: plan; build the vision engine (TensorRT-RTX, no GPU
# needed) and the LLM checkpoint; the LLM engine needs TensorRT-LLM, so here the build stops
# there with exit code 3 (the message gives the container command that finishes it) after
# writing the reference-flavor repository, which needs no engine; validate the repositories
# (reference, and trt once both engines exist); serve the
# reference flavor, ask one question about a generated picture, print the streamed answer and
# the timings, stop the server.
demo: install
	test -d demo/tiny-qwen3-vl || $(BIN)/python scripts/make_tiny_checkpoint.py demo/tiny-qwen3-vl
	$(BIN)/qvl-trt plan --model demo/tiny-qwen3-vl --gpu 4090d
	$(BIN)/qvl-trt build --model demo/tiny-qwen3-vl --gpu 4090d --out demo/build || test $$? -eq 3
	for r in demo/build/repo/*; do $(BIN)/qvl-trt validate $$r || exit 1; done
	$(BIN)/python scripts/demo_serve.py demo/build/repo/reference --work-dir demo

lint: install
	$(BIN)/ruff check qvl_trt tests scripts triton_repo
