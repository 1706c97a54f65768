"""The one gate for heavy optional dependencies: import them here, lazily, inside the
functions that need them, so `--help` and light commands stay fast and a missing package
gives one line naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import DependencyError


def require(module: str, *, extra: str, why: str) -> ModuleType:
    """Import `module` or raise DependencyError naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(
            f"{module} is needed to {why} but cannot be imported ({exc}); "
            f"install it with: pip install 'qvl-trt[{extra}]'"
        ) from None


def available(module: str) -> bool:
    """True if `module` imports (used by `doctor` and test markers)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
