"""What this machine has: Python packages, GPUs, a tritonserver, and which GPU profiles it can
build for (`qvl-trt doctor`), and the device a PyTorch model runs on. Versions come from
package metadata, so nothing heavy is imported."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import __version__
from .profiles import TrtEdition, load_profile, profile_names

# distribution names, first match wins (TensorRT-RTX ships per CUDA major)
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12"),
    "tensorrt_rtx": ("tensorrt-rtx-cu13-bindings", "tensorrt-rtx-cu12-bindings", "tensorrt-rtx"),
    "tensorrt_llm": ("tensorrt-llm", "tensorrt_llm"),
    "tritonclient": ("tritonclient",),
    "nvidia-pytriton": ("nvidia-pytriton",),
    "av": ("av",),  # PyAV: video files
    "cuda_runtime": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12"),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: str
    memory_mib: int
    driver: str


@dataclass(frozen=True)
class ProfileSupport:
    profile: str
    vision_engine: str  # "yes" or the reason it cannot be built here
    llm_engine: str


@dataclass(frozen=True)
class Report:
    qvl_trt: str
    python: str
    platform: str
    packages: dict[str, str | None]
    gpus: tuple[Gpu, ...]
    tritonserver: str | None
    profiles: tuple[ProfileSupport, ...]


def package_version(key: str) -> str | None:
    for dist in PACKAGES[key]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cuda_version() -> str | None:
    """The CUDA toolkit version: $CUDA_VERSION as NVIDIA's containers set it, else the CUDA
    runtime wheel's (pip installs of torch or TensorRT bring one)."""
    return os.environ.get("CUDA_VERSION") or package_version("cuda_runtime")


def pick_device(device: str) -> str:
    """"auto": the first CUDA device when torch sees one, else the CPU."""
    if device != "auto":
        return device
    from .deps import require

    torch = require("torch", extra="export", why="run a PyTorch model")
    return "cuda" if torch.cuda.is_available() else "cpu"


def detect_gpus() -> tuple[Gpu, ...]:
    """GPUs as nvidia-smi reports them (none when it is absent or fails)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ()
    try:
        out = subprocess.run(
            [
                smi,
                "--query-gpu=name,compute_cap,memory.total,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return ()
    gpus = []
    for line in out.strip().splitlines():
        name, cc, mem, driver = (part.strip() for part in line.split(","))
        gpus.append(Gpu(name, cc, int(float(mem)), driver))
    return tuple(gpus)


def profile_support(
    packages: dict[str, str | None], gpus: tuple[Gpu, ...]
) -> tuple[ProfileSupport, ...]:
    ccs = {g.compute_capability for g in gpus}
    rows = []
    for name in profile_names():
        p = load_profile(name)
        cc = p.gpu.compute_capability
        gpu_here = cc in ccs
        if p.gpu.trt_edition is TrtEdition.TENSORRT_RTX:
            vision = "yes" if packages["tensorrt_rtx"] else "no: install qvl-trt[rtx]"
        elif not packages["tensorrt"]:
            vision = "no: needs full TensorRT (NGC container)"
        else:
            vision = "yes" if gpu_here else f"no: needs a GPU of compute capability {cc}"
        if not packages["tensorrt_llm"]:
            llm = "checkpoint only: engine needs TensorRT-LLM (NGC container)"
        else:
            llm = "yes" if gpu_here else f"checkpoint only: engine needs a {cc} GPU"
        rows.append(ProfileSupport(name, vision, llm))
    return tuple(rows)


# ---- tritonserver: PATH, the NGC container's location, or the nvidia-pytriton wheel's ----

NGC_TRITON_HOME = Path("/opt/tritonserver")


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backends: Path
    origin: str  # "PATH" | "ngc" | "pytriton"
    version: str | None


def find_tritonserver() -> TritonInstall | None:
    """The first tritonserver found, in order: PATH, /opt/tritonserver, nvidia-pytriton."""
    on_path = shutil.which("tritonserver")
    if on_path:
        binary = Path(on_path).resolve()
        home = binary.parent.parent
        if (home / PYTRITON_STUBS).is_dir():
            # nvidia-pytriton's server reached through PATH (from another environment): it
            # needs the same stub set-up as when found through the package.
            return _pytriton_install(home)
        return TritonInstall(binary, home / "backends", "PATH", _version_file(home))
    ngc = NGC_TRITON_HOME / "bin" / "tritonserver"
    if ngc.is_file():
        return TritonInstall(
            ngc, NGC_TRITON_HOME / "backends", "ngc", _version_file(NGC_TRITON_HOME)
        )
    try:
        spec = importlib.util.find_spec("pytriton")
    except ImportError:  # a broken or blocked install counts as absent
        spec = None
    if spec and spec.submodule_search_locations:
        home = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        if (home / "bin" / "tritonserver").is_file():
            return _pytriton_install(home)
    return None


# nvidia-pytriton's layout: python backend stubs per Python version beside the backends.
PYTRITON_STUBS = "python_backend_stubs"


def _pytriton_install(home: Path) -> TritonInstall:
    # nvidia-pytriton 0.7 bundles Triton 2.51; the binary has no --version.
    try:
        version = f"bundled with nvidia-pytriton {metadata.version('nvidia-pytriton')}"
    except metadata.PackageNotFoundError:
        version = "bundled with nvidia-pytriton"
    return TritonInstall(home / "bin" / "tritonserver", home / "backends", "pytriton", version)


def _version_file(home: Path) -> str | None:
    path = home / "TRITON_VERSION"
    return path.read_text().strip() if path.is_file() else None


def environment_report() -> Report:
    packages = {key: package_version(key) for key in PACKAGES}
    gpus = detect_gpus()
    triton = find_tritonserver()
    triton_desc = f"{triton.binary} ({triton.origin}, {triton.version})" if triton else None
    return Report(
        qvl_trt=__version__,
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        packages=packages,
        gpus=gpus,
        tritonserver=triton_desc,
        profiles=profile_support(packages, gpus),
    )
