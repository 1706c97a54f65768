"""Shared fixtures. Nothing here may reach a model hub: tests build what they need."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before any test imports huggingface_hub, which reads these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-VL checkpoint (default TinyDims, seed 0, tied, float32, one
    safetensors file), built once per session. Treat it as read-only."""
    from qvl_trt.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
