"""Run the real `qvl-trt` entry point in a child process, optionally with packages made
unimportable, the way a user without an extra installed would meet it."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "tensorrt",
         "tensorrt_rtx", "tensorrt_rtx_bindings", "tensorrt_llm", "tritonclient", "pytriton",
         "aiohttp", "prometheus_client", "grpc")

_BOOT = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(",")) - {""}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
sys.argv = ["qvl-trt"] + sys.argv[2:]
from qvl_trt.cli import main
main()
"""


def run_cli(*args: str, block: tuple[str, ...] = (), timeout: float = 300,
            **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BOOT, ",".join(block), *args],
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def modules_loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement`."""
    code = f"{statement}\nimport sys\nprint(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return set(done.stdout.split())
