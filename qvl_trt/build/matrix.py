"""`qvl-trt matrix`: one CI job per GPU profile, as JSON a CI system fans out.

GitHub Actions takes the result as `strategy.matrix: ${{ fromJSON(...) }}` (the `include`
list); `.github/workflows/engines.yml` is the worked example. Each job carries the runner
labels for its GPU's compute capability, the container that builds it, and the cache key the
build's manifest will have, computed from the same inputs without building.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..checkpoint import open_checkpoint
from ..deploy.container import TRTLLM_CONTAINER
from ..errors import ConfigError
from ..hashing import FileHasher
from ..manifest import cache_key
from ..plan import planned_profile
from ..profiles import GpuProfile, TrtEdition, load_profile, profile_names, sm_digits
from ..typed_config import to_jsonable
from .context import BuildOptions
from .runner import build_inputs

# TensorRT-LLM (every LLM engine) and full TensorRT (vision engines of data-center profiles)
# come in this container; TensorRT-RTX installs into it from PyPI (the `rtx` extra).


@dataclass(frozen=True)
class MatrixJob:
    gpu: str  # profile name, the value of `qvl-trt build --gpu`
    description: str
    compute_capability: str
    runner: tuple[str, ...]  # runs-on labels: a self-hosted runner with such a GPU
    container: str
    trt_edition: str
    extras: str  # `pip install "qvl-trt[<extras>]"` inside the container
    build_dir: str
    cache_key: str  # equals the `cache_key` in the finished build's manifest.json
    cache_prefix: str  # restores the newest older build of this profile (stages skip)


def runner_labels(compute_capability: str) -> tuple[str, ...]:
    """Self-hosted runner labels for a GPU of this compute capability (`gpu-sm89` ...):
    engines are specific to it, so any card of the same capability can build them."""
    return ("self-hosted", "linux", "x64", f"gpu-sm{sm_digits(compute_capability)}")


def select_profiles(gpus: str) -> list[tuple[str, GpuProfile]]:
    """(`--gpu` value, profile) for `all` or a comma-separated list of names or .toml paths."""
    names = profile_names() if gpus.strip() == "all" else [g.strip() for g in gpus.split(",")]
    names = [n for n in names if n]
    if not names:
        raise ConfigError("--gpus is empty; pass `all` or profile names such as 4090d,h100")
    return [(n, load_profile(n)) for n in names]


def ci_matrix(model: Path, gpus: str = "all", *, build_root: str = "build") -> dict[str, Any]:
    """The matrix for building `model` on each selected profile (hashes the checkpoint once)."""
    ckpt = open_checkpoint(model)
    hasher = FileHasher()
    jobs = []
    for gpu, profile in select_profiles(gpus):
        options = BuildOptions(model=str(Path(model).resolve()), gpu=gpu)
        key = cache_key(build_inputs(options, ckpt, planned_profile(ckpt, profile), hasher))
        rtx = profile.gpu.trt_edition is TrtEdition.TENSORRT_RTX
        jobs.append(
            MatrixJob(
                gpu=gpu,
                description=profile.gpu.description,
                compute_capability=profile.gpu.compute_capability,
                runner=runner_labels(profile.gpu.compute_capability),
                container=TRTLLM_CONTAINER,
                trt_edition=profile.gpu.trt_edition.value,
                extras="export,serve,rtx" if rtx else "export,serve",
                build_dir=f"{build_root}/{profile.name}",
                cache_key=key,
                cache_prefix=key.rsplit("-", 1)[0] + "-",
            )
        )
    return {"qvl_trt": __version__, "model": str(model), "include": to_jsonable(jobs)}
