"""The tiny checkpoint's reference-flavor repository, for the scripts that serve it: what
tests/conftest.py builds (the tiny checkpoint, its converted LLM, the repository) with the
small profile, some limits overridden."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.gateway.options import GatewayOptions
from qvl_trt.serve.gateway_process import GatewayProcess
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.small_profile import small_profile_toml
from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint
from qvl_trt.testing.token_generator import install_token_generator
from qvl_trt.triton import contract as c
from qvl_trt.triton.layout import VERSION
from qvl_trt.triton.options import Flavor
from qvl_trt.triton.repository import (
    BuildInput,
    RepoOptions,
    RepoResult,
    write_repo,
)


def build_tiny_reference_repo(root: Path, **limits: float) -> RepoResult:
    """The repository at root/repo (its build beside it); `limits` override the small
    profile's (small_profile.LIMITS)."""
    root.mkdir(parents=True, exist_ok=True)
    profile = root / "profile.toml"
    profile.write_text(small_profile_toml(**limits))
    ckpt = write_tiny_checkpoint(root / "ckpt")
    build = root / "build"
    run_build(BuildOptions(model=str(ckpt), gpu=str(profile)), build,
              only=(Stage.LLM_CHECKPOINT,))
    return write_repo([BuildInput(build)], root / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  vision_cache_mib=64))


def build_generator_repo(root: Path, *, streams: int, tokens: int,
                         tokens_per_s: float) -> RepoResult:
    """The tiny reference repository with tensorrt_llm replaced by the benchmark's token
    generator (`tokens_per_s` per stream), room for `streams` in one in-flight batch and for
    `tokens` generated after a prompt of up to 1024."""
    repo = build_tiny_reference_repo(root, max_batch_size=streams, max_seq_len=1024 + tokens,
                                     max_num_tokens=1024 + tokens)
    install_token_generator(repo.path / c.TENSORRT_LLM / VERSION, tokens_per_s)
    return repo


@contextmanager
def served_generator(root: Path, *, streams: int, tokens: int, tokens_per_s: float,
                     **gateway: Any) -> Iterator[tuple[TritonServer, GatewayProcess]]:
    """The generator repository (build_generator_repo) served by tritonserver with the
    gateway in front, both ready, their logs in `root`; `gateway` holds GatewayOptions'
    fields beyond the upstream and port."""
    repo = build_generator_repo(root, streams=streams, tokens=tokens, tokens_per_s=tokens_per_s)
    with TritonServer(ServerOptions(repo.path, free_ports()), log_file=root / "server.log",
                      startup_timeout_s=300) as server:
        opts = GatewayOptions(server.grpc_url, port=free_ports().http, **gateway)
        with GatewayProcess(opts, log_file=root / "gateway.log") as process:
            process.wait_ready()
            yield server, process
