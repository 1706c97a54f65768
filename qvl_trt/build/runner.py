"""`qvl-trt build`: inspect -> plan -> vision -> llm_checkpoint -> llm -> repo -> manifest.

Each stage writes into a staging folder that is renamed to `<out>/<stage>/` only when the
stage succeeds, and records in the manifest a fingerprint of what it was built from. A stage
whose fingerprint and outputs are unchanged is skipped, so re-running a build is cheap and a
build stopped on one machine (exit code 3) can be resumed on another with `--resume`.

Before the first stage runs, `--out` is checked (a folder, writable) and every wanted stage's
`check` refuses what would make it fail later (missing tokenizer, impossible TP size, a
TensorRT edition that cannot build for the GPU). A filesystem error during a stage (disk
full, read-only, permissions, a file in the way) becomes one BuildError naming the path, the
cause and the fix, and no staging folder is left behind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..atomic import leftovers, staged_dir
from ..checkpoint import Checkpoint, open_checkpoint
from ..dtypes import WeightOnly
from ..errors import BuildError, ConfigError, StageUnavailable
from ..gateway.options import DEFAULT_PORT
from ..hashing import FileHasher, fingerprint
from ..manifest import BuildOptions, Manifest, cache_key, varying_outputs
from ..plan import planned_profile
from ..profiles import GpuProfile, load_profile
from ..triton.options import Flavor
from ..typed_config import to_jsonable
from ..workload import Workload
from .context import (
    NEEDS,
    PREREQUISITES,
    STAGES,
    BuildContext,
    BuildResult,
    Stage,
    StageResult,
    StageSpec,
)
from .stages import SPECS

log = logging.getLogger(__name__)


def run_build(
    options: BuildOptions, out: Path, *, only: tuple[Stage, ...] | None = None, force: bool = False
) -> BuildResult:
    """Run the build's stages into `out`; `only` restricts it to those stages (and their
    prerequisites), `force` rebuilds stages whose inputs did not change."""
    out = Path(out).resolve()
    try:
        return _build(options, out, only, force)
    except OSError as exc:
        raise BuildError(os_error_line(exc, out)) from None


def _build(options: BuildOptions, out: Path, only: tuple[Stage, ...] | None,
           force: bool) -> BuildResult:
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out} is a file, not a folder; pass a folder path (created if "
                         "missing)")
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        manifest = Manifest.load(out) or Manifest()
        if manifest.options and manifest.options.model != options.model:
            raise BuildError(
                f"{out} holds a build of {manifest.options.model}, not {options.model}; "
                "pick another --out folder"
            )
        _remove_leftovers(out)
        manifest.options = options
        hasher = FileHasher(manifest.file_hashes)
        checkpoint = open_checkpoint(options.model)
        ctx = BuildContext(
            options,
            out,
            checkpoint,
            planned_profile(checkpoint, load_profile(options.gpu), options.weights,
                            options.tp_size, options.workload),
            manifest,
            hasher,
        )
        manifest.inputs = build_inputs(options, ctx.checkpoint, ctx.profile, hasher)
        manifest.cache_key = cache_key(manifest.inputs)
        wanted = (set(only) | set(PREREQUISITES) | {n for s in only for n in NEEDS.get(s, ())}
                  if only else set(STAGES))
        _preflight([spec for spec in SPECS if spec.stage in wanted], ctx)
        results = []
        try:
            try:
                for spec in SPECS:
                    if spec.stage in wanted:
                        results.append(_run_stage(spec, ctx, force))
            except StageUnavailable as exc:
                served = _reference_repo_instead(ctx, wanted, force)
                if served is None:
                    raise
                raise StageUnavailable(f"{exc}. Meanwhile {served}") from None
        except OSError:
            _remove_leftovers(out)  # the failed stage's staging folder, whatever wrote it
            with suppress(OSError):  # a full disk may refuse this too; the cause is above
                manifest.save(out)
            raise
        except BaseException:
            manifest.save(out)
            raise
        # Keeps the hash cache warm (files re-hashed after a touch) for the next run.
        manifest.save(out)
        return BuildResult(out, tuple(results))


def _reference_repo_instead(ctx: BuildContext, wanted: set[Stage], force: bool) -> str | None:
    """When a stage cannot run here (the LLM engine without TensorRT-LLM) but the converted
    checkpoint exists, the repo stage still writes the reference-flavor repository (PyTorch
    vision tower and decoder, any machine), which is validated: what to say about it, or None
    when there is none to write."""
    from ..triton.validate import validate_repo

    spec = next(s for s in SPECS if s.stage is Stage.REPO)
    done = ctx.manifest.stages.get(Stage.LLM_CHECKPOINT.value)
    if Stage.REPO not in wanted or not done or not (
            _outputs_intact(ctx.stage_dir(Stage.LLM_CHECKPOINT), done.get("outputs", {}),
                            ctx.hasher)):
        return None
    _run_stage(spec, ctx, force)
    repo = ctx.stage_dir(Stage.REPO) / Flavor.REFERENCE.value
    report = validate_repo(repo)
    if not report.ok:
        raise BuildError(f"the reference repository {repo} fails validation: "
                         f"{report.problems[0]}; run `qvl-trt validate {repo}` for all of it")
    return (f"the reference-flavor repository (PyTorch vision tower and decoder, on any "
            f"machine) is written and validated: serve it with `qvl-trt serve {repo} "
            f"--openai-port {DEFAULT_PORT}`")


def _preflight(specs: list[StageSpec], ctx: BuildContext) -> None:
    """Run every wanted stage's check before any stage, so a build that cannot finish is
    refused in a second rather than after minutes of export and conversion. A stage this
    machine cannot run (StageUnavailable) is let through: the stages before it still run
    and the build stops there, to be resumed elsewhere."""
    for spec in specs:
        if spec.check is not None:
            try:
                spec.check(ctx)
            except StageUnavailable:
                pass


# What to do about a filesystem error, by errno.
_OS_FIXES = {
    errno.ENOSPC: "free space there or pass --out on a larger filesystem",
    errno.EDQUOT: "free space within your quota or pass --out elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f) or pass --out elsewhere",
    errno.EROFS: "the filesystem is read-only; pass a writable --out",
    errno.EACCES: "make it writable for this user or pass another --out",
    errno.EPERM: "make it writable (chattr -i if immutable) or pass another --out",
    errno.EEXIST: "a file is in the way of a folder; remove it or pass another --out",
    errno.ENOTDIR: "a file is in the way of a folder; remove it or pass another --out",
}


def os_error_line(exc: OSError, out: Path) -> str:
    """One line for a filesystem error of a build into `out`: the path, the cause, the fix."""
    path = exc.filename or out
    fix = _OS_FIXES.get(exc.errno or 0, "fix it or pass another --out")
    cause = exc.strerror or str(exc)
    return f"build into {out} failed: {path}: {cause} (errno {exc.errno}); {fix}"


def build_inputs(
    options: BuildOptions, checkpoint: Checkpoint, profile: GpuProfile, hasher: FileHasher
) -> dict[str, Any]:
    """What a build as a whole is made from, free of this machine's paths: the checkpoint's
    file hashes, the profile's content (with the limits planned for the checkpoint) and the
    options. `qvl-trt matrix` derives the same
    cache key from it without building."""
    profile_json = {k: v for k, v in to_jsonable(profile).items() if k != "source"}
    options_json = {k: v for k, v in options.to_json().items() if k not in ("model", "gpu")}
    return {
        "checkpoint": checkpoint_hashes(checkpoint, hasher),
        "profile": profile_json,
        "options": options_json,
    }


def resume_build(out: Path, *, only: tuple[Stage, ...] | None = None,
                 force: bool = False, weights: WeightOnly | None = None,
                 workload: Workload | None = None) -> BuildResult:
    """Continue the build recorded in `out/manifest.json` with its own options (`only` as
    in `run_build`); `weights` and `workload`, when given, must be the build's (a CI job
    resuming a folder restored from a cache checks it holds the variant it is for)."""
    manifest = Manifest.load(Path(out))
    if manifest is None or manifest.options is None:
        raise BuildError(
            f"{out} holds no build manifest; start with `qvl-trt build --model M --gpu G --out DIR`"
        )
    options = manifest.options
    if weights is not None and WeightOnly.parse(weights) is not options.weights:
        raise ConfigError(f"{out} holds a build with --weights {options.weights}, not "
                          f"{weights}; drop --weights to resume it, or build {weights} into "
                          "its own --out folder")
    if workload is not None and Workload.parse(workload) is not options.workload:
        raise ConfigError(f"{out} holds a build with --workload {options.workload}, not "
                          f"{workload}; drop --workload to resume it, or build {workload} into "
                          "its own --out folder")
    return run_build(options, Path(out), only=only, force=force)


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
    if spec.check is not None:
        spec.check(ctx)
    log.info("stage %s: started", name)
    started = time.perf_counter()
    with staged_dir(final) as work:
        summary = spec.run(ctx, work)
    seconds = time.perf_counter() - started
    outputs = ctx.hasher.hash_tree(final)
    ctx.manifest.stages[name] = {
        "fingerprint": fp,
        "inputs": inputs,
        "outputs": outputs,
        # Outputs a build of the same inputs may write differently; the others it may not.
        "varies": varying_outputs(spec.stage, outputs, ctx.trt_edition),
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


def checkpoint_hashes(ckpt: Checkpoint, hasher: FileHasher) -> dict[str, str]:
    """sha256 of every checkpoint file a build reads: configs, tokenizer, weights."""
    return {name: hasher.hash(ckpt.path / name) for name in ckpt.build_files}
