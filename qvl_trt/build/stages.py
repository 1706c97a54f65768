"""The build's stages, in order: each a function of its inputs (what its output depends on)
and a function that writes its folder. The vision and repo stages have modules of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import write_json_atomic
from ..child import REPRODUCE_NAME
from ..dtypes import LLM_ENGINE_DTYPE, WeightOnly
from ..errors import StageUnavailable
from ..hashing import fingerprint
from ..manifest import PROFILE_NAME, write_reproduce_script
from ..plan import check_fits, make_plan
from ..profiles import load_profile
from ..typed_config import to_jsonable
from .context import BuildContext, Stage, StageSpec
from .repo_stage import check_repo_stage, repo_stage_inputs, run_repo_stage
from .vision_stage import check_vision_stage, run_vision_stage, vision_stage_inputs


def _inspect_inputs(ctx: BuildContext) -> dict[str, Any]:
    return {"checkpoint": ctx.manifest.inputs["checkpoint"]}


def _run_inspect(ctx: BuildContext, work: Path) -> dict[str, Any]:
    # Without the checkpoint's path: equal checkpoints give an equal file wherever they are.
    summary = {k: v for k, v in ctx.checkpoint.summary().items() if k != "path"}
    write_json_atomic(work / "inspect.json", summary)
    return {"variant": summary["variant"], "parameters": summary["parameters"]}


def _plan_inputs(ctx: BuildContext) -> dict[str, Any]:
    inputs = {
        "config": ctx.hasher.hash(ctx.checkpoint.path / "config.json"),
        "profile": to_jsonable(ctx.profile),
        "weights": ctx.options.weights.value,
    }
    # Absent at TP 1, so the plan stages of builds made before the planner planned TP keep
    # their fingerprint.
    if ctx.options.tp_size != 1:
        inputs["tp_size"] = ctx.options.tp_size
    return inputs


def _run_plan(ctx: BuildContext, work: Path) -> dict[str, Any]:
    # Planned against the profile as shipped, so that plan.json names what was lowered;
    # its limits are ctx.profile's, which profile.json records and every later stage uses.
    plan = make_plan(ctx.checkpoint, load_profile(ctx.options.gpu), ctx.options.weights,
                     ctx.options.tp_size, ctx.options.workload)
    check_fits(plan)
    write_json_atomic(work / "plan.json", to_jsonable(plan))
    write_json_atomic(work / PROFILE_NAME, to_jsonable(ctx.profile))
    return {
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "concurrent_typical_requests": plan.concurrent_typical_requests,
        "concurrent_typical_videos": plan.concurrent_typical_videos,
        "lowered": {c.key: [c.profile_value, c.value] for c in plan.lowered},
    }


def _manifest_inputs(ctx: BuildContext) -> dict[str, Any]:
    # Every other stage's record: the manifest stage reruns whenever any of them was rebuilt.
    others = {
        name: fingerprint([rec["fingerprint"], rec["outputs"]])
        for name, rec in ctx.manifest.stages.items()
        if name != Stage.MANIFEST.value
    }
    return {"build": ctx.manifest.inputs, "model": ctx.options.model, "stages": others}


def _run_manifest(ctx: BuildContext, work: Path) -> dict[str, Any]:
    ctx.manifest.tools = ctx.tools
    write_reproduce_script(ctx.manifest, work / REPRODUCE_NAME)
    seconds = {
        name: rec["seconds"]
        for name, rec in ctx.manifest.stages.items()
        if name != Stage.MANIFEST.value
    }
    return {"qvl_trt": __version__, "cache_key": ctx.manifest.cache_key, "seconds": seconds}


def _check_llm_checkpoint(ctx: BuildContext) -> None:
    from ..llm.convert import llm_config_for

    llm_config_for(ctx.checkpoint, dtype=LLM_ENGINE_DTYPE, tp_size=ctx.options.tp_size,
                   max_seq_len=ctx.profile.limits.max_seq_len, weights=ctx.options.weights)


def _llm_checkpoint_inputs(ctx: BuildContext) -> dict[str, Any]:
    o = ctx.options
    # `weights` only when quantized: fp16 conversions made before the option stay current.
    # `quantized_by`: weight-only checkpoints of earlier versions held our own integers, which
    # TensorRT-LLM's loader would take as laid out for its GEMM; a resumed build converts
    # them again.
    weights = {} if o.weights is WeightOnly.NONE else {"weights": o.weights.value,
                                                       "quantized_by": "tensorrt_llm"}
    return {"checkpoint": ctx.manifest.inputs["checkpoint"], "dtype": LLM_ENGINE_DTYPE.value,
            "tp_size": o.tp_size, "max_seq_len": ctx.profile.limits.max_seq_len, **weights}


def _run_llm_checkpoint(ctx: BuildContext, work: Path) -> dict[str, Any]:
    from ..llm.convert import convert_checkpoint

    # `work` is the stage's empty staging folder; convert replaces it with the finished
    # checkpoint (config.json + rank{N}.safetensors).
    result = convert_checkpoint(ctx.checkpoint, work, max_seq_len=ctx.profile.limits.max_seq_len,
                                dtype=LLM_ENGINE_DTYPE, tp_size=ctx.options.tp_size,
                                weights=ctx.options.weights, force=True)
    return {"dtype": result.config.dtype, "weights": result.config.weight_only.value,
            "tp_size": result.config.tp_size,
            "max_position_embeddings": result.config.max_position_embeddings,
            "bytes": result.total_bytes}


def _llm_build_config(ctx: BuildContext) -> dict[str, Any]:
    from ..llm.engine import engine_build_config

    return engine_build_config(ctx.profile, deepstack_layers=ctx.checkpoint.vision.deepstack_count,
                               weights=ctx.options.weights)


def _llm_inputs(ctx: BuildContext) -> dict[str, Any]:
    # TensorRT-LLM engines are built for the GPU they are built on.
    return {**ctx.upstream(Stage.LLM_CHECKPOINT), "build_config": _llm_build_config(ctx),
            "compute_capability": ctx.profile.gpu.compute_capability}


def _run_llm(ctx: BuildContext, work: Path) -> dict[str, Any]:
    from ..llm.engine import build_engines

    checkpoint = ctx.stage_dir(Stage.LLM_CHECKPOINT)
    try:
        result = build_engines(checkpoint, work, _llm_build_config(ctx))
    except StageUnavailable as exc:
        raise StageUnavailable(
            f"stage llm: {exc}; the converted checkpoint is kept in {checkpoint}. Finish the "
            f"build inside the serving image, the TensorRT-LLM 1.2 container with qvl-trt: "
            f"{ctx.container_command()}"
        ) from None
    return {"tp_size": result.tp_size, "engine_bytes": result.engine_bytes}


SPECS: tuple[StageSpec, ...] = (
    StageSpec(Stage.INSPECT, _inspect_inputs, _run_inspect),
    StageSpec(Stage.PLAN, _plan_inputs, _run_plan),
    StageSpec(Stage.VISION, vision_stage_inputs, run_vision_stage, check_vision_stage),
    StageSpec(Stage.LLM_CHECKPOINT, _llm_checkpoint_inputs, _run_llm_checkpoint,
              _check_llm_checkpoint),
    StageSpec(Stage.LLM, _llm_inputs, _run_llm),
    StageSpec(Stage.REPO, repo_stage_inputs, run_repo_stage, check_repo_stage),
    StageSpec(Stage.MANIFEST, _manifest_inputs, _run_manifest),
)
