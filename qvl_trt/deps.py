"""The one gate for heavy optional dependencies: import them here, lazily, inside the
functions that need them, so `--help` and light commands stay fast and a missing package
gives one line naming the extra to install, or where the package comes with its container."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import DependencyError

# Extras that are not a pip install into this environment: TensorRT-LLM needs its own CUDA
# torch, CUDA toolkit and MPI, which NVIDIA's TensorRT-LLM container holds (with full TensorRT);
# the serving image builds on that container. So a missing package of these names the
# container, not a pip command.
CONTAINER_EXTRAS = frozenset({"trtllm"})
IN_THE_CONTAINER = ("it comes with NVIDIA's TensorRT-LLM container, on which the serving "
                    "image (`qvl-trt image`) builds; run this inside either")


def require(module: str, *, extra: str, why: str) -> ModuleType:
    """Import `module` or raise DependencyError naming the extra that provides it (for a
    container extra, the container)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        fix = (IN_THE_CONTAINER if extra in CONTAINER_EXTRAS
               else f"install it with: pip install 'qvl-trt[{extra}]'")
        raise DependencyError(
            f"{module} is needed to {why} but cannot be imported ({exc}); {fix}") from None


def available(module: str) -> bool:
    """True if `module` imports (used by `doctor` and test markers)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
