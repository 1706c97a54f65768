"""Markers of the test tiers that run only where TensorRT-LLM and a GPU are."""

from __future__ import annotations

import importlib.util

import pytest

from qvl_trt.deploy.container import TRTLLM_CONTAINER


def trtllm_gpu_marks(needs: str) -> list:
    """`pytestmark` of a module that needs TensorRT-LLM 1.2 and a CUDA GPU; `needs` says
    what else, for the printed skip reason."""
    torch = pytest.importorskip("torch")
    return [
        pytest.mark.trtllm,
        pytest.mark.gpu,
        pytest.mark.skipif(
            importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available(),
            reason=f"needs {needs}; run scripts/verify_gpu.sh (NGC container "
            f"{TRTLLM_CONTAINER})"),
    ]
