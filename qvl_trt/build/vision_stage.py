"""The `vision` build stage: export (or reuse) the ONNX graph, validate it against Hugging
Face, build the engine with the profile's edition. The export with its validation and the
engine build each run in a child process; this one imports no torch and waits.

Stage folder: `onnx/` (the export + validation.txt), `export_config.json`, `export.log`,
`reproduce_export.sh` (when exported, not reused), `model.engine`, `config.json`,
`build_config.json`, `build.log`, `reproduce.sh` and, with full TensorRT, `timing.cache`.
A failed export, validation or engine build is kept as `<out>/vision.failed/`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import BuildError, StageUnavailable
from ..machine import package_version
from ..manifest import (
    ONNX_DIR,
    ONNX_NAME,
    TIMING_CACHE_NAME,
    VALIDATION_NAME,
    VISION_FAILED_DIR,
)
from ..profiles import TrtEdition
from ..typed_config import to_jsonable
from ..vision.engine import (
    EngineBuildConfig,
    build_vision_engine,
    check_edition_here,
)
from ..vision.export import export_inputs, read_export_meta
from ..vision.spec import patch_range, vision_graph_spec
from ..vision.validate import ExportConfig, export_and_validate_in_child
from .context import BuildContext, Stage

log = logging.getLogger(__name__)


def vision_stage_inputs(ctx: BuildContext) -> dict[str, Any]:
    """What the vision stage's output depends on: the export's inputs and the engine's."""
    profile = ctx.profile
    edition = ctx.trt_edition
    return {
        "export": export_inputs(ctx.checkpoint, ctx.options.vision_dtype, edition,
                                ctx.hasher.hash),
        "engine": {
            "edition": edition.value,
            "trt_version": package_version("tensorrt_rtx" if edition is
                                           TrtEdition.TENSORRT_RTX else "tensorrt"),
            "compute_capabilities": [profile.gpu.compute_capability],
            "patches": to_jsonable(patch_range(ctx.checkpoint.vision, profile.limits)),
            "builder_optimization_level": profile.vision_build.builder_optimization_level,
            "workspace_gib": profile.vision_build.workspace_gib,
        },
    }


def check_vision_stage(ctx: BuildContext) -> None:
    # The TensorRT-LLM container has full TensorRT; the target GPU must be there too.
    check_edition_here(ctx.trt_edition, (ctx.profile.gpu.compute_capability,),
                       ctx.container_command)


def run_vision_stage(ctx: BuildContext, work: Path) -> dict[str, Any]:

    dtype = ctx.options.vision_dtype
    inputs = vision_stage_inputs(ctx)
    engine = inputs["engine"]
    ccs = tuple(engine["compute_capabilities"])

    onnx_dir = work / ONNX_DIR
    previous = ctx.stage_dir(Stage.VISION) / ONNX_DIR
    reused = _reuse_export(previous, onnx_dir, inputs["export"],
                           ctx.stage_outputs(Stage.VISION), ctx.hasher)
    seconds = {"export": 0.0, "validate": 0.0}  # wall time per phase (0: export reused)
    spec = vision_graph_spec(ctx.checkpoint.vision, dtype)
    config = EngineBuildConfig(
        edition=ctx.trt_edition, dtype=dtype, onnx=f"{ONNX_DIR}/{ONNX_NAME}",
        compute_capabilities=ccs, patches=patch_range(ctx.checkpoint.vision, ctx.profile.limits),
        builder_optimization_level=engine["builder_optimization_level"],
        workspace_gib=engine["workspace_gib"], inputs=spec.inputs, outputs=spec.outputs,
        sources={"weights": inputs["export"]["weights"]})
    # The last engine's tactic timings (full TensorRT only): the rebuild starts from them.
    cache = ctx.stage_dir(Stage.VISION) / TIMING_CACHE_NAME
    if cache.is_file():
        shutil.copy2(cache, work / TIMING_CACHE_NAME)
    failed = ctx.out / VISION_FAILED_DIR
    try:
        if not reused:
            times = export_and_validate_in_child(work, ExportConfig(
                checkpoint=str(Path(ctx.checkpoint.path).resolve()), out=ONNX_DIR, dtype=dtype,
                edition=ctx.trt_edition, inputs=inputs["export"]))
            seconds.update(export=times.export_seconds, validate=times.validate_seconds)
            log.info("validation vs Hugging Face:")
            for line in (onnx_dir / VALIDATION_NAME).read_text().splitlines():
                log.info("  %s", line)
        started = time.perf_counter()
        built = build_vision_engine(work, config)
    except StageUnavailable:
        raise
    except BuildError as exc:
        # The staging folder is deleted when the stage fails: keep it, so that the log and
        # the reproduce script the message names still exist.
        shutil.rmtree(failed, ignore_errors=True)
        os.replace(work, failed)
        raise BuildError(str(exc).replace(str(work), str(failed))) from None
    shutil.rmtree(failed, ignore_errors=True)
    seconds["engine"] = time.perf_counter() - started
    return {"edition": built["edition"], "trt_version": built["trt_version"], "dtype": dtype,
            "compute_capabilities": built["compute_capabilities"],
            "patches": built["patches"], "engine_mib": round(built["engine_bytes"] / 2**20, 1),
            "onnx": "reused" if reused else "exported",
            "seconds": {k: round(v, 2) for k, v in seconds.items()}}


def _reuse_export(previous: Path, dest: Path, export: dict[str, Any],
                  recorded: dict[str, str], hasher) -> bool:
    """Link the previous build's export into `dest` when it was made from the same inputs
    and its files are the ones the manifest recorded: a profile change rebuilds the engine
    without re-exporting."""
    meta = read_export_meta(previous)
    if meta is None or meta.get("inputs") != export:
        return False
    files = sorted(p for p in previous.iterdir() if p.is_file())
    for path in files:
        key = f"{ONNX_DIR}/{path.name}"
        if key not in recorded or recorded[key] != hasher.hash(path):
            log.info("previous ONNX export differs from the manifest (%s); exporting again",
                     path.name)
            return False
    dest.mkdir()
    for path in files:
        try:
            os.link(path, dest / path.name)
        except OSError:  # another filesystem, or links unsupported
            shutil.copy2(path, dest / path.name)
    log.info("reusing the ONNX export in %s (same weights, dtype and edition)", previous)
    return True
