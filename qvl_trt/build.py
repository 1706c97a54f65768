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
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint, open_checkpoint
from .errors import BuildError
from .manifest import FileHasher, Manifest, fingerprint, write_json_atomic
from .plan import check_fits, make_plan
from .profiles import GpuProfile, TrtEdition, load_profile
from .typed_config import to_jsonable

log = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    INSPECT = "inspect"
    PLAN = "plan"
    VISION = "vision"
    LLM = "llm"
    REPO = "repo"
    MANIFEST = "manifest"


STAGES = tuple(Stage)
# Stages that always run (cheaply, usually skipped) because later ones read their results.
PREREQUISITES = (Stage.INSPECT, Stage.PLAN)


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
    with _locked(out):
        manifest = Manifest.load(out) or Manifest()
        if manifest.options and manifest.options.get("model") != options.model:
            raise BuildError(
                f"{out} holds a build of {manifest.options.get('model')}, not {options.model}; "
                "pick another --out folder"
            )
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
        wanted = set(only) | set(PREREQUISITES) if only else set(STAGES)
        results = []
        for spec in _SPECS:
            if spec.stage in wanted:
                results.append(_run_stage(spec, ctx, force))
        return BuildResult(out, tuple(results))


def resume_build(out: Path, *, force: bool = False) -> BuildResult:
    """Continue the build recorded in `out/manifest.json` with its own options."""
    manifest = Manifest.load(Path(out))
    if manifest is None or not manifest.options:
        raise BuildError(
            f"{out} holds no build manifest; start with `qvl-trt build --model M --gpu G --out DIR`"
        )
    return run_build(BuildOptions.from_json(manifest.options), Path(out), force=force)


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
    work = ctx.out / f".staging-{name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        summary = spec.run(ctx, work)
        _replace_dir(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - started
    ctx.manifest.stages[name] = {
        "fingerprint": fp,
        "inputs": inputs,
        "outputs": ctx.hasher.hash_tree(final),
        "seconds": round(seconds, 3),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summary,
    }
    ctx.manifest.save(ctx.out)
    log.info("stage %s: done in %.1f s", name, seconds)
    return StageResult(spec.stage, "built", seconds, summary)


def _outputs_intact(root: Path, outputs: dict[str, str], hasher: FileHasher) -> bool:
    return root.is_dir() and hasher.hash_tree(root) == outputs


def _replace_dir(src: Path, dst: Path) -> None:
    """Move `src` to `dst`, replacing an older `dst` only once `src` is complete."""
    old = dst.with_name(f".old-{dst.name}-{os.getpid()}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One build at a time per output folder."""
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


def _checkpoint_inputs(ctx: BuildContext) -> dict[str, Any]:
    ckpt = ctx.checkpoint
    files = ["config.json"] + sorted({i.file for i in ckpt.tensors.values()})
    return {name: ctx.hasher.hash(ckpt.path / name) for name in files}


def _inspect_inputs(ctx: BuildContext) -> dict[str, Any]:
    return {"checkpoint": _checkpoint_inputs(ctx)}


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


def _not_implemented(stage: Stage) -> Callable[[BuildContext, Path], dict[str, Any]]:
    def run(ctx: BuildContext, work: Path) -> dict[str, Any]:
        raise BuildError(
            f"stage {stage.value} is not implemented in this version of qvl-trt; "
            f"the stages before it are in {ctx.out}"
        )

    return run


def _no_inputs(ctx: BuildContext) -> dict[str, Any]:
    return {}


_SPECS: tuple[StageSpec, ...] = (
    StageSpec(Stage.INSPECT, _inspect_inputs, _run_inspect),
    StageSpec(Stage.PLAN, _plan_inputs, _run_plan),
    StageSpec(Stage.VISION, _no_inputs, _not_implemented(Stage.VISION)),
    StageSpec(Stage.LLM, _no_inputs, _not_implemented(Stage.LLM)),
    StageSpec(Stage.REPO, _no_inputs, _not_implemented(Stage.REPO)),
    StageSpec(Stage.MANIFEST, _no_inputs, _not_implemented(Stage.MANIFEST)),
)
