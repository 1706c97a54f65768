"""The NGC TensorRT-LLM container, and `docker run` lines that run qvl-trt (or a server) in
it: the build finishes its LLM engine there, a trt repository is served there."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

# Triton 2.71 with TensorRT-LLM 1.2.1, the last line with the TensorRT engine path.
TRTLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"


def container_command(out: Path, inputs: Sequence[Path], *, shm_bytes: int,
                      extras: Sequence[str] = ()) -> str:
    """A `docker run` line that runs `qvl-trt build --resume out` inside the TensorRT-LLM
    container, with `out` and `inputs` (checkpoint, profile file) mounted at their own paths
    so the manifest's paths and file hashes stay valid (`container_run`)."""
    return container_run([Path(out), *inputs], f"qvl-trt build --resume "
                         f"{shlex.quote(str(Path(out).resolve()))}",
                         shm_bytes=shm_bytes, extras=extras)


def container_run(mounts: Sequence[Path], command: str, *, shm_bytes: int,
                  extras: Sequence[str] | None = (), ports: Sequence[int] = ()) -> str:
    """`docker run` of `command` in the TensorRT-LLM container, `mounts` at their own paths,
    with shared memory for the python backend, which passes every tensor between models
    through /dev/shm (Docker's default is 64 MB). qvl-trt is installed first with `extras`
    (e.g. "rtx": the container's pinned requirements carry no TensorRT-RTX, which GeForce
    profiles' vision engines need); `extras=None` installs nothing."""
    source = Path(__file__).resolve().parents[1]
    paths = [Path(p).resolve() for p in mounts]
    if extras is not None:
        extra = f"[{','.join(extras)}]" if extras else ""
        if (source / "pyproject.toml").is_file():
            # A source checkout: installed editable, its build_configs/ beside the package.
            paths.append(source)
            install = f"pip install -q -e {shlex.quote(f'{source}{extra}')}"
        else:
            install = f"pip install -q {shlex.quote(f'qvl-trt{extra}')}"
        command = f"{install} && {command}"
    volumes = " ".join(f"-v {shlex.quote(f'{p}:{p}')}" for p in dict.fromkeys(paths))
    published = "".join(f" -p {p}:{p}" for p in ports)
    return (f"docker run --rm --gpus all --shm-size={shm_flag(shm_bytes)}{published} "
            f"{volumes} {TRTLLM_CONTAINER} bash -c {shlex.quote(command)}")


def shm_flag(nbytes: int) -> str:
    """A docker --shm-size value of at least `nbytes`, in whole GiB."""
    return f"{max(1, -(-nbytes // 2**30))}g"
