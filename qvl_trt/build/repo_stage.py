"""The `repo` build stage: the build's Triton repositories, `<out>/repo/<flavor>/`.

`reference` is written whenever the converted LLM checkpoint exists; `trt` once both engines
exist (the LLM engine is built in the TensorRT-LLM container: a build stopped before it
writes the reference flavor only, and `qvl-trt build --resume` adds the trt one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import __version__
from ..checkpoint import PREPROCESSING_REQUIRED_FILES
from ..errors import CheckpointError
from ..triton.options import Flavor
from ..triton.repository import BuildInput, RepoOptions, write_repo
from .context import BuildContext, Stage


def check_repo_stage(ctx: BuildContext) -> None:
    missing = [n for n in PREPROCESSING_REQUIRED_FILES if not (ctx.checkpoint.path / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{ctx.checkpoint.path} has no {', '.join(missing)}, which the Triton repository's "
            "preprocessing and postprocessing read; copy them from the original Hugging Face "
            "checkpoint, or leave the repo stage out (--only vision,llm_checkpoint,llm)")


def repo_stage_inputs(ctx: BuildContext) -> dict[str, Any]:

    # plan: its profile.json holds the limits the configs are made from.
    return {"upstream": ctx.upstream(Stage.PLAN, Stage.VISION, Stage.LLM_CHECKPOINT, Stage.LLM),
            "checkpoint": ctx.manifest.inputs["checkpoint"], "qvl_trt": __version__}


def run_repo_stage(ctx: BuildContext, work: Path) -> dict[str, Any]:

    final = ctx.stage_dir(Stage.REPO)
    flavors = [Flavor.REFERENCE]
    if ctx.folder.vision_engine.is_file() and ctx.folder.llm_engine_config.is_file():
        flavors.insert(0, Flavor.TRT)
    for flavor in flavors:
        # gpt_model_path names where the stage folder ends up, not the staging folder.
        write_repo([BuildInput(ctx.out)], work / flavor.value,
                   RepoOptions(flavor=flavor, mount_path=str(final / flavor.value)))
    return {"flavors": [f.value for f in flavors]}
