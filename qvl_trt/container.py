"""The NGC TensorRT-LLM container, and `docker run` lines that run qvl-trt (or a server) in
the serving image built on it (deploy/image.py): the build finishes its LLM engine there, a
trt repository is served there."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

# Triton 2.71 with TensorRT-LLM 1.2.1, the last line with the TensorRT engine path.
TRTLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"


def container_command(out: Path, inputs: Sequence[Path], *, image: str, shm_bytes: int) -> str:
    """A `docker run` line that runs `qvl-trt build --resume out` in `image`, with `out` and
    `inputs` (checkpoint, profile file) mounted at their own paths so the manifest's paths
    and file hashes stay valid (`container_run`)."""
    return container_run([Path(out), *inputs], f"qvl-trt build --resume "
                         f"{shlex.quote(str(Path(out).resolve()))}",
                         image=image, shm_bytes=shm_bytes)


def container_run(mounts: Sequence[Path], command: str, *, image: str, shm_bytes: int,
                  ports: Sequence[int] = ()) -> str:
    """`docker run` of `command` in `image`, `mounts` at their own paths, with shared memory
    for the python backend, which passes every tensor between models through /dev/shm
    (Docker's default is 64 MB). The image has what the command needs installed: nothing is
    installed when the container starts (a GPU node may have no package index)."""
    paths = [Path(p).resolve() for p in mounts]
    volumes = " ".join(f"-v {shlex.quote(f'{p}:{p}')}" for p in dict.fromkeys(paths))
    published = "".join(f" -p {p}:{p}" for p in ports)
    return (f"docker run --rm --gpus all --shm-size={shm_flag(shm_bytes)}{published} "
            f"{volumes} {shlex.quote(image)} {command}")


def shm_gib(nbytes: int) -> int:
    """Whole GiB of shared memory holding at least `nbytes` (1 at least)."""
    return max(1, -(-nbytes // 2**30))


def shm_flag(nbytes: int) -> str:
    """A docker --shm-size value of at least `nbytes`, in whole GiB."""
    return f"{shm_gib(nbytes)}g"
