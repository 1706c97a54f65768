"""A Python environment that holds what the serving image holds, on a machine without the
TensorRT-LLM container: the container's packages at its versions where they install here
(deploy/trtllm_container.toml `here`), then exactly what a recipe's requirements.txt adds,
resolved against those as the image build resolves them (pinned, nothing upgraded).

The base is made once and kept (keyed by its requirements, in `cache_root()`); a recipe's
layer is a venv of its own that sees the base through a .pth file, so each recipe costs only
its additions.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

from ..deploy.image import check_environment_requirements, load_container_packages
from ..errors import QvlError

STAMP = ".complete"


def env_python(env: Path) -> Path:
    return Path(env) / "bin" / "python"


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def pip(python: Path, *args: str, target: Path | None = None) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    if target is not None:
        cmd += ["--python", str(env_python(target))]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise QvlError(f"pip {' '.join(args[:1])} failed in {target or python}:\n{tail}")


def cache_root() -> Path:
    """Where kept environments live, shared by every checkout of this machine (each is keyed
    by what it holds): $XDG_CACHE_HOME/qvl-trt, else ~/.cache/qvl-trt."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qvl-trt"


def kept_env(root: Path, name: str, key: Sequence[str], fill: Callable[[Path], None]) -> Path:
    """The venv `root`/`name`-<digest of this Python and `key`>, which `fill(its python)`
    fills once: later calls, from any checkout, find it complete; calls at the same time wait
    for the first (a lock beside it). A venv left half-made is made again."""
    digest = hashlib.sha256("\n".join([sys.version, *key]).encode()).hexdigest()[:12]
    env = Path(root) / f"{name}-{digest}"
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env / STAMP).is_file():
            shutil.rmtree(env, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
            fill(env_python(env))
            (env / STAMP).write_text("\n".join(key) + "\n")
    return env


def base_env(root: Path) -> Path:
    """The container's packages (those that install here), in `root`/base-<digest>."""
    requirements = check_environment_requirements(load_container_packages())
    return kept_env(root, "base", requirements,
                    lambda python: pip(python, "install", *requirements))


def layered_env(base: Path, requirements: Path, dest: Path) -> Path:
    """A venv at `dest` over `base` with what `requirements` adds, constrained to every
    version `base` has (the image build's `pip list --format=freeze` constraints)."""
    base_python = env_python(base)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    (site_packages(env_python(dest)) / "_container_base.pth").write_text(
        f"{site_packages(base_python)}\n")
    frozen = subprocess.run([str(base_python), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    constraints = Path(dest) / "constraints.txt"
    constraints.write_text(frozen)
    pip(base_python, "install", "-c", str(constraints), "-r", str(requirements), target=dest)
    return Path(dest)


def image_env_vars(env: Path, context: Path) -> dict[str, str]:
    """The environment a command in the image would have: qvl_trt from the recipe's copy
    (the image's PYTHONPATH), this environment's Python first on PATH, and a tritonserver
    (nvidia-pytriton's, from the environment running the tests) after it."""
    from ..machine import find_tritonserver

    install = find_tritonserver()
    path = [str(Path(env) / "bin")]
    if install is not None:
        path.append(str(install.binary.parent))
    libdir = sysconfig.get_config_var("LIBDIR")
    vars_ = {**os.environ, "PYTHONPATH": str(Path(context) / "qvl-trt"),
             "PATH": os.pathsep.join([*path, os.environ.get("PATH", "")])}
    if libdir:
        vars_["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    vars_.pop("PYTHONHOME", None)
    return vars_
