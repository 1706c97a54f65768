"""What every build stage works with: the stage names and their order, the context a stage
function receives (the build options, manifest.py BuildOptions, among it), and the result
records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..checkpoint import Checkpoint
from ..deploy.container import container_command
from ..hashing import FileHasher, fingerprint
from ..manifest import IMAGE_DIR, BuildFolder, BuildOptions, Manifest, Stage, tool_versions
from ..plan import make_plan
from ..profiles import GpuProfile, TrtEdition

STAGES = tuple(Stage)
# Stages that always run (cheaply, usually skipped) because later ones read their results.
PREREQUISITES = (Stage.INSPECT, Stage.PLAN)
# Earlier stages a stage reads, run with it when `--only` names it.
NEEDS = {Stage.LLM: (Stage.LLM_CHECKPOINT,), Stage.REPO: (Stage.LLM_CHECKPOINT,)}


@dataclass
class BuildContext:
    """What stage functions receive. `profile` is the one the build uses: `--gpu`'s with the
    limits the planner derives for the checkpoint, weights and TP size
    (plan.planned_profile)."""

    options: BuildOptions
    out: Path
    checkpoint: Checkpoint
    profile: GpuProfile
    manifest: Manifest
    hasher: FileHasher

    @property
    def trt_edition(self) -> TrtEdition:
        return self.options.trt_edition or self.profile.gpu.trt_edition

    @property
    def folder(self) -> BuildFolder:
        return BuildFolder(self.out)

    def stage_dir(self, stage: Stage) -> Path:
        return self.folder.stage(stage)

    def stage_outputs(self, stage: Stage) -> dict[str, str]:
        return self.manifest.stages.get(stage.value, {}).get("outputs", {})

    def upstream(self, *stages: Stage) -> dict[str, str]:
        """Fingerprints of earlier stages' outputs, for a stage's `inputs`: the stage then
        reruns when, and only when, what it reads from them changed."""
        return {s.value: fingerprint(self.stage_outputs(s)) for s in stages}

    def container_command(self) -> str:
        """The lines that resume this build in the serving image: `docker build` of the image
        recipe written to IMAGE_DIR here (TensorRT-RTX in it for a GeForce profile, whose
        vision engine the resumed build may touch), then `docker run`, mounting the
        checkpoint and a user's own profile file (shipped ones come with qvl-trt)."""
        from ..deploy.image import write_image_recipe

        own_profile = self.options.gpu.endswith(".toml")
        inputs = [Path(self.options.model)] + ([Path(self.profile.source)] if own_profile else [])
        recipe = write_image_recipe(self.out / IMAGE_DIR,
                                    rtx=self.trt_edition is TrtEdition.TENSORRT_RTX)
        run = container_command(self.out, inputs, image=recipe.tag,
                                shm_bytes=make_plan(self.checkpoint, self.profile,
                                                    self.options.weights,
                                                    self.options.tp_size,
                                                    self.options.workload).shm_bytes)
        return f"{recipe.build_command} && {run}"

    @cached_property
    def tools(self) -> dict[str, Any]:
        """Tool versions of this machine, looked up once per build and only if a stage runs."""
        return tool_versions()


@dataclass(frozen=True)
class StageSpec:
    stage: Stage
    # JSON-able description of everything the stage's output depends on.
    inputs: Callable[[BuildContext], dict[str, Any]]
    # Writes the stage's files into the given (empty) folder; returns a small summary.
    run: Callable[[BuildContext, Path], dict[str, Any]]
    # Refuses, cheaply and before any stage runs, what would make the stage fail: missing
    # files, impossible options, tools this machine lacks (StageUnavailable: raised again
    # when the stage is reached, after the stages before it have run).
    check: Callable[[BuildContext], None] | None = None


@dataclass(frozen=True)
class StageResult:
    stage: Stage
    status: str  # "built" | "skipped"
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildResult:
    out: Path
    stages: tuple[StageResult, ...]
