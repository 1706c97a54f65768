"""Shared by the scripts that serve the tiny checkpoint: build what tests/conftest.py builds
(the tiny checkpoint, its converted LLM, the reference-flavor repository) with the tests'
small profile, some limits overridden."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from small_profile import small_profile_toml  # noqa: E402

from qvl_trt.build import BuildOptions, Stage, run_build  # noqa: E402
from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from qvl_trt.testing.token_generator import install_token_generator  # noqa: E402
from qvl_trt.triton import contract as c  # noqa: E402
from qvl_trt.triton.model_configs import Flavor  # noqa: E402
from qvl_trt.triton.repository import (  # noqa: E402
    VERSION,
    BuildInput,
    RepoOptions,
    RepoResult,
    write_repo,
)


def build_tiny_reference_repo(root: Path, **limits: float) -> RepoResult:
    """The repository at root/repo (its build beside it); `limits` override the small
    profile's (tests/small_profile.py LIMITS)."""
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
