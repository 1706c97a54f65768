"""A Python environment that holds what the serving image holds, on a machine without the
TensorRT-LLM container: the container's Python (deploy/trtllm_container.toml `python`) with
the container's packages at its versions where they install here (`here`), then exactly what
a recipe's requirements.txt adds, resolved against those as the image build resolves them
(pinned, nothing upgraded); and a tritonserver of its own for that Python.

The base is made once and kept (keyed by its interpreter and requirements, in `cache_root()`);
a recipe's layer is a venv of its own that sees the base through a .pth file, so each recipe
costs only its additions.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..deploy.image import check_environment_requirements, load_container_packages
from ..errors import QvlError

if TYPE_CHECKING:
    from ..machine import TritonInstall

STAMP = ".complete"
# An interpreter of the container's Python to build the environment with, where the search of
# `container_python` would not find it.
PYTHON_VAR = "QVL_TRT_CONTAINER_PYTHON"


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


@dataclass(frozen=True)
class Interpreter:
    executable: Path  # the real one (not a pyenv shim)
    version: str  # its sys.version
    libdir: str  # where its libpython is ("" where it has none)

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])


def interpreter(python: Path | str) -> Interpreter | None:
    """What `python` is, asked by running it; None where it does not run (a pyenv shim of a
    version pyenv has not selected exits 127)."""
    try:
        done = subprocess.run([str(python), "-c", "import sys, sysconfig; print(sys.executable);"
                               "print(sys.version); print(sysconfig.get_config_var('LIBDIR') "
                               "or '')"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 3:
        return None
    return Interpreter(Path(lines[0]), lines[1], lines[2])


def container_python(version: str) -> Interpreter | None:
    """An interpreter of Python `version` (e.g. "3.12"): $QVL_TRT_CONTAINER_PYTHON where set
    (and nothing else), else `python<version>` on PATH, else pyenv's newest <version>.x."""
    if os.environ.get(PYTHON_VAR):
        candidates = [os.environ[PYTHON_VAR]]
    else:
        pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
        installed = [p for p in pyenv.glob(f"{version}.*/bin/python{version}")
                     if p.parents[1].name.removeprefix(f"{version}.").isdigit()]
        installed.sort(key=lambda p: int(p.parents[1].name.removeprefix(f"{version}.")))
        candidates = [shutil.which(f"python{version}"), *reversed(installed)]
    for candidate in filter(None, candidates):
        found = interpreter(candidate)
        if found is not None and found.minor == version:
            return found
    return None


def cache_root() -> Path:
    """Where kept environments live, shared by every checkout of this machine (each is keyed
    by what it holds): $XDG_CACHE_HOME/qvl-trt, else ~/.cache/qvl-trt."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qvl-trt"


def kept_env(root: Path, name: str, key: Sequence[str], fill: Callable[[Path], None],
             python: Interpreter | None = None) -> Path:
    """The venv of `python` (default: this one) `root`/`name`-<digest of its version and
    `key`>, which `fill(its python)` fills once: later calls, from any checkout, find it
    complete; calls at the same time wait for the first (a lock beside it). A venv left
    half-made is made again."""
    python = python or Interpreter(Path(sys.executable), sys.version, "")
    digest = hashlib.sha256("\n".join([python.version, *key]).encode()).hexdigest()[:12]
    env = Path(root) / f"{name}-{digest}"
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env / STAMP).is_file():
            shutil.rmtree(env, ignore_errors=True)
            subprocess.run([str(python.executable), "-m", "venv", str(env)], check=True)
            fill(env_python(env))
            (env / STAMP).write_text("\n".join(key) + "\n")
    return env


def base_env(root: Path, python: Interpreter) -> Path:
    """The container's packages (those that install here) in a venv of `python`, the
    container's Python, `root`/base-<digest>."""
    requirements = check_environment_requirements(load_container_packages())
    return kept_env(root, "base", requirements,
                    lambda env: pip(env, "install", *requirements), python)


def layered_env(base: Path, requirements: Path, dest: Path) -> Path:
    """A venv at `dest` over `base` with what `requirements` adds, constrained to every
    version `base` has (the image build's `pip list --format=freeze` constraints)."""
    base_python = env_python(base)
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(dest)], check=True)
    (site_packages(env_python(dest)) / "_container_base.pth").write_text(
        f"{site_packages(base_python)}\n")
    frozen = subprocess.run([str(base_python), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    constraints = Path(dest) / "constraints.txt"
    constraints.write_text(frozen)
    pip(base_python, "install", "-c", str(constraints), "-r", str(requirements), target=dest)
    return Path(dest)


def own_tritonserver(install: TritonInstall, dest: Path, python: Interpreter) -> Path:
    """A tritonserver for `python` at `dest`, returning the folder to put on PATH: the NGC
    install as it is; nvidia-pytriton's as a tree of links to its files with a python
    backend folder of its own, holding `python`'s stub. `prepare_tritonserver` (serve/
    server.py), run under `python`, then finds that stub in place, and never replaces the
    shared install's, which servers of another Python (the tests') may be starting."""
    from ..machine import PYTRITON_STUBS
    from ..serve.server import STUB_NAME

    if install.origin != "pytriton":
        return install.binary.parent
    home = install.binary.parent.parent  # site-packages/pytriton/tritonserver
    tree = Path(dest) / home.parent.name / home.name
    # Each binary finds the wheel's libraries through an RPATH relative to itself
    # ($ORIGIN/../../../../nvidia_pytriton.libs from backends/python), so the tree keeps the
    # wheel's depth beside a link to that folder.
    libs = home.parents[1] / "nvidia_pytriton.libs"
    if libs.is_dir():
        (Path(dest) / libs.name).symlink_to(libs)
    (tree / "bin").mkdir(parents=True)
    # find_tritonserver resolves links, which would lead back to the shared tree: the
    # binary is a hard link (or a copy across filesystems).
    try:
        os.link(install.binary, tree / "bin" / install.binary.name)
    except OSError:
        shutil.copy2(install.binary, tree / "bin" / install.binary.name)
    for entry in home.iterdir():
        if entry.name not in ("bin", "backends"):
            (tree / entry.name).symlink_to(entry)
    own = tree / "backends" / "python"
    own.mkdir(parents=True)
    for backend in install.backends.iterdir():
        if backend.name != "python":
            (tree / "backends" / backend.name).symlink_to(backend)
    for entry in (install.backends / "python").iterdir():
        if entry.name not in (STUB_NAME, "__pycache__"):
            (own / entry.name).symlink_to(entry)
    shutil.copy2(home / PYTRITON_STUBS / python.minor / STUB_NAME, own / STUB_NAME)
    return tree / "bin"


def image_env_vars(env: Path, context: Path, tritonserver: Path | None = None
                   ) -> dict[str, str]:
    """The environment a command in the image would have: qvl_trt from the recipe's copy
    (the image's PYTHONPATH), this environment's Python first on PATH, and the folder
    `tritonserver` (see `own_tritonserver`) after it."""
    found = interpreter(env_python(env))
    if found is None:
        raise QvlError(f"{env_python(env)} does not run")
    path = [str(Path(env) / "bin"), *([str(tritonserver)] if tritonserver else [])]
    vars_ = {**os.environ, "PYTHONPATH": str(Path(context) / "qvl-trt"),
             "PATH": os.pathsep.join([*path, os.environ.get("PATH", "")])}
    if found.libdir:
        vars_["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (found.libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    vars_.pop("PYTHONHOME", None)
    return vars_
