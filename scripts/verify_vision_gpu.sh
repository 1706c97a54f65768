#!/bin/sh
# Vision engines on a GPU: tests/test_vision_gpu.py. Run from the repository root.
#  - full TensorRT: inside the NGC container nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3
#    (TensorRT + torch + a data-center GPU), after `pip install -e '.[export,dev]'`;
#  - TensorRT-RTX: on an RTX-class GPU (compute capability 8.0/8.6/8.9/12.x) with
#    `pip install -e '.[export,rtx,dev]'`.
# Tests whose edition or GPU is absent are skipped with the reason printed.
set -e
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest tests/test_vision_gpu.py -v -rs -s "$@"
