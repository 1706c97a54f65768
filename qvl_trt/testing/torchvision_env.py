"""An interpreter where transformers' torchvision-backed processors run, for comparisons with
this environment's own code. PyPI's torchvision wheels link PyPI's (CUDA) torch, which imports
without a GPU, while this environment keeps a CPU torch that no torchvision wheel matches. So a
venv holds that torch/torchvision pair alone; a script run there adds this environment's
packages (transformers, numpy, Pillow) after its own with `site.addsitedir(CALLER_SITE)`, so
the transformers compared with is the installed one.

Made on first use (about 3 GB of wheels) and kept in `cache_root()`, as the container
environment is (container_env.py).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from ..deps import available
from .container_env import env_python, kept_env, pip

# The PyPI pair: torchvision 0.29.1 requires torch==2.14.1.
TORCH_PAIR = ("torch==2.14.1", "torchvision==0.29.1")
# What a script run by torchvision_python() passes to site.addsitedir first.
CALLER_SITE = sysconfig.get_paths()["purelib"]


def _fill(python: Path) -> None:
    torch, torchvision = TORCH_PAIR
    pip(python, "install", torch)
    pip(python, "install", "--no-deps", torchvision)  # numpy and Pillow: the caller's


def torchvision_python(root: Path) -> Path:
    """This interpreter where torch and torchvision import together (a GPU machine's), else
    the kept venv `root`/torchvision-<digest>, made if missing."""
    if available("torchvision"):
        return Path(sys.executable)
    return env_python(kept_env(root, "torchvision", TORCH_PAIR, _fill))
