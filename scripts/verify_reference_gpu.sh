#!/bin/sh
# The reference decoder on CUDA against Hugging Face on CUDA (fp32 and fp16): the `gpu` tests
# of tests/test_llm_reference.py. Run on a machine with a CUDA GPU and torch, after
# `pip install -e '.[export,dev]'`; nothing is downloaded (the tests build a tiny checkpoint).
set -e
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest tests/test_llm_reference.py -m gpu -v -rs "$@"
