"""Finding a tritonserver binary: PATH, the NGC container's location, or the one bundled in
the nvidia-pytriton wheel (python backend only)."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

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
            # nvidia-pytriton 0.7 bundles Triton 2.51; the binary has no --version.
            from importlib.metadata import version

            return TritonInstall(
                home / "bin" / "tritonserver",
                home / "backends",
                "pytriton",
                f"bundled with nvidia-pytriton {version('nvidia-pytriton')}",
            )
    return None


def _version_file(home: Path) -> str | None:
    path = home / "TRITON_VERSION"
    return path.read_text().strip() if path.is_file() else None
