"""`qvl-trt build`: inspect -> plan -> vision -> llm -> repo -> manifest.

Each stage writes into a staging folder that is renamed to `<out>/<stage>/` only when the
stage succeeds, and records in the manifest a fingerprint of what it was built from. A stage
whose fingerprint and outputs are unchanged is skipped, so re-running a build is cheap and a
build stopped on one machine (exit code 3) can be resumed on another with `--resume`.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import leftovers, staged_dir, write_json_atomic
from .checkpoint import Checkpoint, open_checkpoint
from .errors import BuildError, StageUnavailable
from .manifest import (
    FileHasher,
    Manifest,
    cache_key,
    fingerprint,
    reproduce_script,
    tool_versions,
)
from .plan import check_fits, make_plan
from .profiles import GpuProfile, TrtEdition, load_profile
from .triton.stage import repo_stage_inputs, run_repo_stage
from .typed_config import to_jsonable
from .vision.stage import run_vision_stage, vision_stage_inputs

log = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    INSPECT = "inspect"
    PLAN = "plan"
    VISION = "vision"
    LLM_CHECKPOINT = "llm_checkpoint"
    LLM = "llm"
    REPO = "repo"
    MANIFEST = "manifest"


STAGES = tuple(Stage)
# Stages that always run (cheaply, usually skipped) because later ones read their results.
PREREQUISITES = (Stage.INSPECT, Stage.PLAN)
# Earlier stages a stage reads, run with it when `--only` names it.
NEEDS = {Stage.LLM: (Stage.LLM_CHECKPOINT,), Stage.REPO: (Stage.LLM_CHECKPOINT,)}


@dataclass(frozen=True)
class BuildOptions:
    """Everything a build depends on besides the files it reads; stored in the manifest."""

    model: str
    gpu: str
    trt_edition: TrtEdition | None = None
    vision_dtype: str = "float16"
    llm_dtype: str = "float16"
    tp_size: int = 1

    def to_json(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BuildOptions:
        edition = data.get("trt_edition")
        return cls(**{**data, "trt_edition": TrtEdition(edition) if edition else None})


@dataclass
class BuildContext:
    """What stage functions receive."""

    options: BuildOptions
    out: Path
    checkpoint: Checkpoint
    profile: GpuProfile
    manifest: Manifest
    hasher: FileHasher

    @property
    def trt_edition(self) -> TrtEdition:
        return self.options.trt_edition or self.profile.gpu.trt_edition

    def stage_dir(self, stage: Stage) -> Path:
        return self.out / stage.value

    def stage_outputs(self, stage: Stage) -> dict[str, str]:
        return self.manifest.stages.get(stage.value, {}).get("outputs", {})

    def upstream(self, *stages: Stage) -> dict[str, str]:
        """Fingerprints of earlier stages' outputs, for a stage's `inputs`: the stage then
        reruns when, and only when, what it reads from them changed."""
        return {s.value: fingerprint(self.stage_outputs(s)) for s in stages}

    def container_command(self) -> str:
        """The `docker run` line that resumes this build in the TensorRT-LLM container,
        mounting the checkpoint and a user's own profile file (shipped ones come with
        qvl-trt)."""
        from .llm.engine import container_command

        own_profile = self.options.gpu.endswith(".toml")
        inputs = [Path(self.options.model)] + ([Path(self.profile.source)] if own_profile else [])
        # A GeForce profile's TensorRT-RTX vision engine needs the rtx extra there too (the
        # container ships full TensorRT only), should the resumed build touch it.
        rtx = self.trt_edition is TrtEdition.TENSORRT_RTX
        return container_command(self.out, inputs, extras=("rtx",) if rtx else (),
                                 shm_bytes=make_plan(self.checkpoint, self.profile).shm_bytes)

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


def run_build(
    options: BuildOptions, out: Path, *, only: tuple[Stage, ...] | None = None, force: bool = False
) -> BuildResult:
    """Run the build's stages into `out`; `only` restricts it to those stages (and their
    prerequisites), `force` rebuilds stages whose inputs did not change."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        manifest = Manifest.load(out) or Manifest()
        if manifest.options and manifest.options.get("model") != options.model:
            raise BuildError(
                f"{out} holds a build of {manifest.options.get('model')}, not {options.model}; "
                "pick another --out folder"
            )
        _remove_leftovers(out)
        manifest.options = options.to_json()
        hasher = FileHasher(manifest.file_hashes)
        ctx = BuildContext(
            options,
            out,
            open_checkpoint(options.model),
            load_profile(options.gpu),
            manifest,
            hasher,
        )
        manifest.inputs = build_inputs(options, ctx.checkpoint, ctx.profile, hasher)
        manifest.cache_key = cache_key(manifest.inputs)
        wanted = (set(only) | set(PREREQUISITES) | {n for s in only for n in NEEDS.get(s, ())}
                  if only else set(STAGES))
        results = []
        try:
            for spec in _SPECS:
                if spec.stage in wanted:
                    results.append(_run_stage(spec, ctx, force))
        finally:
            # Keeps the hash cache warm (files re-hashed after a touch) for the next run.
            manifest.save(out)
        return BuildResult(out, tuple(results))


def build_inputs(
    options: BuildOptions, checkpoint: Checkpoint, profile: GpuProfile, hasher: FileHasher
) -> dict[str, Any]:
    """What a build as a whole is made from, free of this machine's paths: the checkpoint's
    file hashes, the profile's content and the options. `qvl-trt matrix` derives the same
    cache key from it without building."""
    profile_json = {k: v for k, v in to_jsonable(profile).items() if k != "source"}
    options_json = {k: v for k, v in options.to_json().items() if k not in ("model", "gpu")}
    return {
        "checkpoint": checkpoint_hashes(checkpoint, hasher),
        "profile": profile_json,
        "options": options_json,
    }


def resume_build(out: Path, *, only: tuple[Stage, ...] | None = None,
                 force: bool = False) -> BuildResult:
    """Continue the build recorded in `out/manifest.json` with its own options (`only` as
    in `run_build`)."""
    manifest = Manifest.load(Path(out))
    if manifest is None or not manifest.options:
        raise BuildError(
            f"{out} holds no build manifest; start with `qvl-trt build --model M --gpu G --out DIR`"
        )
    return run_build(BuildOptions.from_json(manifest.options), Path(out), only=only,
                     force=force)


def _run_stage(spec: StageSpec, ctx: BuildContext, force: bool) -> StageResult:
    name = spec.stage.value
    inputs = spec.inputs(ctx)
    fp = fingerprint(inputs)
    record = ctx.manifest.stages.get(name)
    final = ctx.stage_dir(spec.stage)
    if (
        not force
        and record
        and record.get("fingerprint") == fp
        and _outputs_intact(final, record.get("outputs", {}), ctx.hasher)
    ):
        log.info("stage %s: unchanged, skipped", name)
        return StageResult(spec.stage, "skipped", 0.0, record.get("summary", {}))
    log.info("stage %s: started", name)
    started = time.perf_counter()
    with staged_dir(final) as work:
        summary = spec.run(ctx, work)
    seconds = time.perf_counter() - started
    ctx.manifest.stages[name] = {
        "fingerprint": fp,
        "inputs": inputs,
        "outputs": ctx.hasher.hash_tree(final),
        "seconds": round(seconds, 3),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summary,
        "tools": ctx.tools,
    }
    ctx.manifest.save(ctx.out)
    log.info("stage %s: done in %.1f s", name, seconds)
    return StageResult(spec.stage, "built", seconds, summary)


def _outputs_intact(root: Path, outputs: dict[str, str], hasher: FileHasher) -> bool:
    return root.is_dir() and hasher.hash_tree(root) == outputs


def _remove_leftovers(out: Path) -> None:
    """Staging folders of a build that was killed; safe to remove while holding the lock."""
    for path in leftovers(out):
        log.info("removing %s, left by an interrupted build", path.name)
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """One build at a time per output folder: an exclusive flock on `out/.lock`, released by
    the kernel when the holder exits, so a killed build never leaves a stale lock."""
    lock_path = out / ".lock"
    with lock_path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise BuildError(
                f"another qvl-trt build (pid {f.read().strip() or '?'}) is "
                f"writing {out}; wait for it or use another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- stages -------------------------------------------------------------------------------


# Checkpoint files besides weights and tokenizer that a build reads, when present.
_CHECKPOINT_CONFIGS = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "model.safetensors.index.json",
)


def checkpoint_hashes(ckpt: Checkpoint, hasher: FileHasher) -> dict[str, str]:
    """sha256 of every checkpoint file a build reads: configs, tokenizer, weights."""
    names = [n for n in _CHECKPOINT_CONFIGS if (ckpt.path / n).is_file()]
    names += ckpt.tokenizer_files + sorted({i.file for i in ckpt.tensors.values()})
    return {name: hasher.hash(ckpt.path / name) for name in names}


def _inspect_inputs(ctx: BuildContext) -> dict[str, Any]:
    return {"checkpoint": ctx.manifest.inputs["checkpoint"]}


def _run_inspect(ctx: BuildContext, work: Path) -> dict[str, Any]:
    summary = ctx.checkpoint.summary()
    write_json_atomic(work / "inspect.json", summary)
    return {"variant": summary["variant"], "parameters": summary["parameters"]}


def _plan_inputs(ctx: BuildContext) -> dict[str, Any]:
    return {
        "config": ctx.hasher.hash(ctx.checkpoint.path / "config.json"),
        "profile": to_jsonable(ctx.profile),
    }


def _run_plan(ctx: BuildContext, work: Path) -> dict[str, Any]:
    plan = make_plan(ctx.checkpoint, ctx.profile)
    check_fits(plan)
    write_json_atomic(work / "plan.json", to_jsonable(plan))
    write_json_atomic(work / "profile.json", to_jsonable(ctx.profile))
    return {
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "concurrent_typical_requests": plan.concurrent_typical_requests,
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
    script = work / "reproduce.sh"
    script.write_text(reproduce_script(ctx.manifest))
    script.chmod(0o755)
    seconds = {
        name: rec["seconds"]
        for name, rec in ctx.manifest.stages.items()
        if name != Stage.MANIFEST.value
    }
    return {"qvl_trt": __version__, "cache_key": ctx.manifest.cache_key, "seconds": seconds}


def _llm_checkpoint_inputs(ctx: BuildContext) -> dict[str, Any]:
    o = ctx.options
    return {"checkpoint": ctx.manifest.inputs["checkpoint"], "dtype": o.llm_dtype,
            "tp_size": o.tp_size, "max_seq_len": ctx.profile.limits.max_seq_len}


def _run_llm_checkpoint(ctx: BuildContext, work: Path) -> dict[str, Any]:
    from .llm.convert import convert_checkpoint

    # `work` is the stage's empty staging folder; convert replaces it with the finished
    # checkpoint (config.json + rank{N}.safetensors).
    result = convert_checkpoint(ctx.checkpoint, work, max_seq_len=ctx.profile.limits.max_seq_len,
                                dtype=ctx.options.llm_dtype, tp_size=ctx.options.tp_size,
                                force=True)
    return {"dtype": result.config.dtype, "tp_size": result.config.tp_size,
            "max_position_embeddings": result.config.max_position_embeddings,
            "bytes": result.total_bytes}


def _llm_build_config(ctx: BuildContext) -> dict[str, Any]:
    from .llm.engine import engine_build_config

    return engine_build_config(ctx.profile, deepstack_layers=ctx.checkpoint.vision.deepstack_count,
                               dtype=ctx.options.llm_dtype)


def _llm_inputs(ctx: BuildContext) -> dict[str, Any]:
    # TensorRT-LLM engines are built for the GPU they are built on.
    return {**ctx.upstream(Stage.LLM_CHECKPOINT), "build_config": _llm_build_config(ctx),
            "compute_capability": ctx.profile.gpu.compute_capability}


def _run_llm(ctx: BuildContext, work: Path) -> dict[str, Any]:
    from .llm.engine import build_engines

    checkpoint = ctx.stage_dir(Stage.LLM_CHECKPOINT)
    try:
        result = build_engines(checkpoint, work, _llm_build_config(ctx))
    except StageUnavailable as exc:
        raise StageUnavailable(
            f"stage llm: {exc}; the converted checkpoint is kept in {checkpoint}. Finish the "
            f"build inside the TensorRT-LLM 1.2 container: {ctx.container_command()}"
        ) from None
    return {"tp_size": result.tp_size, "engine_bytes": result.engine_bytes}


_SPECS: tuple[StageSpec, ...] = (
    StageSpec(Stage.INSPECT, _inspect_inputs, _run_inspect),
    StageSpec(Stage.PLAN, _plan_inputs, _run_plan),
    StageSpec(Stage.VISION, vision_stage_inputs, run_vision_stage),
    StageSpec(Stage.LLM_CHECKPOINT, _llm_checkpoint_inputs, _run_llm_checkpoint),
    StageSpec(Stage.LLM, _llm_inputs, _run_llm),
    StageSpec(Stage.REPO, repo_stage_inputs, run_repo_stage),
    StageSpec(Stage.MANIFEST, _manifest_inputs, _run_manifest),
)
