"""`qvl-trt build`: the stage context and runner (`context`, `runner`), every stage
(`stages`, `vision_stage`, `repo_stage`) and the CI matrix (`matrix`)."""

from ..manifest import BuildOptions
from .context import STAGES, BuildContext, BuildResult, Stage, StageResult
from .runner import build_inputs, build_lock, checkpoint_hashes, resume_build, run_build

__all__ = [
    "STAGES", "BuildContext", "BuildOptions", "BuildResult", "Stage", "StageResult",
    "build_inputs", "build_lock", "checkpoint_hashes", "resume_build", "run_build",
]
