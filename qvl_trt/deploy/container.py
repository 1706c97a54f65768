"""The NGC TensorRT-LLM container, and `docker run` lines that run qvl-trt (or a server) in
the serving image built on it (image.py): the build finishes its LLM engine there, a trt
repository is served there."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from ..gateway.options import DEFAULT_PORT
from ..serve.needs import ServeNeeds, shm_flag
from ..serve.server import Ports
from .image import HEALTH_PORT, load_container_packages

# Triton 2.71 with TensorRT-LLM 1.2.1, the last line with the TensorRT engine path; named in
# the container's package data (trtllm_container.toml) beside what it holds.
TRTLLM_CONTAINER = load_container_packages().image


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
    volumes = "".join(f" -v {shlex.quote(f'{p}:{p}')}" for p in dict.fromkeys(paths))
    published = "".join(f" -p {p}:{p}" for p in ports)
    return (f"docker run --rm --gpus all --shm-size={shm_flag(shm_bytes)}{published}"
            f"{volumes} {shlex.quote(image)}{f' {command}' if command else ''}")


def serve_container_command(plan: ServeNeeds, image: str) -> str:
    """The `docker run` line that serves the repository with `qvl-trt serve` in the serving
    image `image` on the default ports, with the shared memory its largest requests need;
    serve takes the world size and BLS threads from the repository."""
    ports = Ports()
    return container_run([plan.repo], shlex.join(["qvl-trt", "serve", str(plan.repo)]),
                         image=image, shm_bytes=plan.shm_bytes,
                         ports=(ports.http, ports.grpc, ports.metrics))


def baked_container_command(plan: ServeNeeds, image: str) -> str:
    """The `docker run` line of an image that carries the repository (`qvl-trt image
    --bake-repo`): no volume and no command, its own serves it
    (image.baked_serve_arguments); the gateway, the health endpoint and the metrics published."""
    return container_run([], "", image=image, shm_bytes=plan.shm_bytes,
                         ports=(DEFAULT_PORT, HEALTH_PORT, Ports().metrics))
