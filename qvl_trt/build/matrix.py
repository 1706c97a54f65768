"""`qvl-trt matrix`: one CI job per (GPU profile, weight precision, workload), as JSON a CI
system fans out.

GitHub Actions takes the result as `strategy.matrix: ${{ fromJSON(...) }}` (the `include`
list); `.github/workflows/engines.yml` is the worked example. Each job carries the runner
labels for its GPU's compute capability, the container that builds it, and the cache key the
build's manifest will have, computed from the same inputs without building.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..checkpoint import open_checkpoint
from ..deploy.container import TRTLLM_CONTAINER
from ..dtypes import WeightOnly
from ..errors import ConfigError, PlanError
from ..hashing import FileHasher
from ..manifest import BuildOptions, build_name, cache_key
from ..plan import check_fits, make_plan, profile_for_plan
from ..profiles import GpuProfile, TrtEdition, load_profile, profile_names, sm_digits
from ..typed_config import to_jsonable
from ..workload import Workload
from .runner import build_inputs

# TensorRT-LLM (every LLM engine) and full TensorRT (vision engines of data-center profiles)
# come in this container; TensorRT-RTX installs into it from PyPI (the `rtx` extra).


@dataclass(frozen=True)
class MatrixJob:
    gpu: str  # profile name, the value of `qvl-trt build --gpu`
    weights: str  # the value of `qvl-trt build --weights`
    workload: str  # the value of `qvl-trt build --workload`
    description: str
    compute_capability: str
    runner: tuple[str, ...]  # runs-on labels: a self-hosted runner with such a GPU
    container: str
    trt_edition: str
    extras: str  # `pip install "qvl-trt[<extras>]"` inside the container
    build_dir: str  # <build root>/<manifest.build_name>: 4090d, 4090d.int8, h200.video
    cache_key: str  # equals the `cache_key` in the finished build's manifest.json
    cache_prefix: str  # restores the newest older build of this profile and weights


@dataclass(frozen=True)
class CiMatrix:
    model: str
    jobs: tuple[MatrixJob, ...]
    # One line per (profile, weights, workload) left out because the checkpoint does not fit
    # the card so: the planner's reason and fix.
    left_out: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"qvl_trt": __version__, "model": self.model, "include": to_jsonable(self.jobs)}


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
    selected = [(n, load_profile(n)) for n in names]
    # Jobs are named after the profile (build_dir, cache key): a name twice is one folder.
    loaded = [p.name for _, p in selected]
    twice = sorted({n for n in loaded if loaded.count(n) > 1})
    if twice:
        raise ConfigError(f"--gpus {gpus}: {', '.join(twice)} given more than once; name each "
                          "profile once")
    return selected


def ci_matrix(model: Path, gpus: str = "all",
              weights: Sequence[WeightOnly] = (WeightOnly.NONE,),
              workloads: Sequence[Workload] = (Workload.CHAT,), *,
              build_root: str = "build") -> CiMatrix:
    """The matrix for building `model` on each selected profile in each weight precision
    and workload (hashes the checkpoint once).

    A pair the planner does not fit (what `qvl-trt plan --gpu all` shows as `-`) is left out
    with its reason in `left_out` rather than refused: `--gpus all --weights none,int8,int4`
    asks for every variant the cards can take, as the plan table shows them, and an 8B fits
    no 16 GB card in fp16. A job for it would only fail at the build's plan stage on the GPU
    runner. PlanError when no pair fits: a matrix without jobs is no CI run."""
    ckpt = open_checkpoint(model)
    hasher = FileHasher()
    jobs, left_out = [], []
    for gpu, profile in select_profiles(gpus):
        for w, load in ((w, load) for w in weights for load in workloads):
            plan = make_plan(ckpt, profile, w, workload=load)
            try:
                check_fits(plan)
            except PlanError as exc:
                words = "" if load is Workload.CHAT else f" --workload {load}"
                left_out.append(f"{gpu} with --weights {w}{words}: {exc}")
                continue
            options = BuildOptions(model=str(Path(model).resolve()), gpu=gpu, weights=w,
                                   workload=load)
            key = cache_key(build_inputs(options, ckpt, profile_for_plan(profile, plan), hasher))
            rtx = profile.gpu.trt_edition is TrtEdition.TENSORRT_RTX
            jobs.append(
                MatrixJob(
                    gpu=gpu,
                    weights=w.value,
                    workload=load.value,
                    description=profile.gpu.description,
                    compute_capability=profile.gpu.compute_capability,
                    runner=runner_labels(profile.gpu.compute_capability),
                    container=TRTLLM_CONTAINER,
                    trt_edition=profile.gpu.trt_edition.value,
                    extras="export,serve,rtx" if rtx else "export,serve",
                    build_dir=f"{build_root}/{build_name(profile.name, w, load)}",
                    cache_key=key,
                    cache_prefix=key.rsplit("-", 1)[0] + "-",
                )
            )
    if not jobs:
        more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
        raise PlanError(f"the matrix has no job, no (GPU, weights, workload) asked for fits"
                        f"{more}: {left_out[0]}")
    return CiMatrix(str(model), tuple(jobs), tuple(left_out))
