"""`qvl-trt repo`: a Triton model repository from one or more build folders.

Per build, six models: preprocessing -> vision_encoder -> tensorrt_llm -> postprocessing,
chained by an ensemble, and tensorrt_llm_bls, the same chain run by BLS from one model
(cancellable by its client). The repository is self-contained: each python model's version
folder holds its model.py (from `triton_repo/`), a zip of the qvl_trt package it imports
(pure Python, pinned to the qvl-trt that wrote it), and the files it reads (tokenizer and
configs, weights or engine), all found relative to model.py. The models put that zip first on
sys.path, so they run the qvl_trt that wrote the repository even where another is installed;
the packages it imports come from where it is served: the serving image (`qvl-trt image`: the
TensorRT-LLM container plus what the models import) or the environment of `qvl-trt serve`.
The only absolute paths are the tensorrtllm backend's gpt_model_path and
xgrammar_tokenizer_info_path (the backend takes no relative ones): they name where the
repository will be mounted (`mount_path`, default: where it is written), and `qvl-trt serve`
re-points them when the repository was moved.

Large files (engines, weights) are hard-linked from the build when on the same filesystem.
The repository is written beside `out` and renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import __version__
from ..atomic import staged_dir, write_json_atomic
from ..checkpoint import VISION_PREFIX, Checkpoint, open_checkpoint
from ..dtypes import LLM_ENGINE_DTYPE, NUMPY_DTYPES, Dtype
from ..errors import BuildError, ConfigError
from ..llm.engine import engine_build_config
from ..llm.guided import BACKEND as GUIDED_DECODING_BACKEND
from ..llm.guided import TokenizerInfo
from ..manifest import (
    BUILD_CONFIG_NAME,
    CONFIG_NAME,
    VISION_ENGINE_NAME,
    BuildFolder,
    BuildOptions,
    Manifest,
    Stage,
)
from ..mm.request import RequestBounds, RequestLimits
from ..mm.rope import MropeTable
from ..plan import Plan, make_plan, repository_kv_budgets
from ..profiles import GpuProfile
from ..resources import data_dir
from ..typed_config import to_jsonable
from ..workload import Workload
from . import contract as c
from .layout import (
    BUILD_INFO,
    CHECKPOINT_DIR,
    ENGINE_DIR,
    MODEL_PY,
    RUNTIME_ZIP,
    TOKENIZER_INFO_NAME,
    TOKENIZER_JSON,
    VERSION,
    VISION_WEIGHTS_NAME,
    BuildInfo,
)
from .model_configs import (
    CANCELLATION_CHECK_PERIOD_MS,
    ENABLE_CHUNKED_CONTEXT,
    ENABLE_KV_CACHE_REUSE,
    StepSettings,
    step_configs,
)
from .options import BuildInput, Flavor, RepoOptions
from .pbconfig import write_config

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

@dataclass(frozen=True)
class RepoBuild:
    name: str | None
    names: c.ModelNames
    source: Path


@dataclass(frozen=True)
class RepoResult:
    path: Path
    flavor: Flavor
    builds: tuple[RepoBuild, ...]
    models: tuple[str, ...] = ()


def write_repo(builds: Sequence[BuildInput], out: Path, options: RepoOptions | None = None,
               *, force: bool = False) -> RepoResult:
    """Write the repository for `builds` at `out` (which must not exist unless `force`;
    `options` None: RepoOptions())."""
    options = options or RepoOptions()
    out = Path(out).absolute()
    if not builds:
        raise ConfigError("give at least one --build folder")
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it or pick another --out")
    named = _resolve_names(builds)
    opened = [_open_build(build.path) for build, _ in named]
    model_names = [c.ModelNames.for_build(name) for _, name in named]
    served = _served_names(opened, model_names)
    plans = [b.plan for b in opened]
    # One server loads every build's engines on the same GPU: the KV budgets are split so
    # that each stays below what the backend's free-memory fraction would give it, whatever
    # order Triton loads the models in. The reference flavor holds no KV cache on a GPU.
    kv_budgets = (repository_kv_budgets(plans) if options.flavor is Flavor.TRT
                  else tuple(p.kv_capacity_tokens for p in plans))
    with staged_dir(out) as staging:
        runtime = staging / f".{RUNTIME_ZIP}"
        write_runtime_zip(runtime)
        results, models = [], []
        for (_, name), names, build, served_name, kv_tokens in zip(
                named, model_names, opened, served, kv_budgets, strict=True):
            _emit_build(build, names, staging, options, runtime, kv_tokens=kv_tokens,
                        mount_root=Path(options.mount_path or out), served_name=served_name)
            results.append(RepoBuild(name, names, build.path))
            models += names.all()
        runtime.unlink()
    log.info("wrote the %s repository %s (%d models)", options.flavor.value, out, len(models))
    return RepoResult(out, options.flavor, tuple(results), tuple(models))


def _resolve_names(builds: Sequence[BuildInput]) -> list[tuple[BuildInput, str | None]]:
    """One build keeps the upstream names unless named; several need distinct names (the
    folder name when not given)."""
    if len(builds) == 1:
        pairs = [(builds[0], builds[0].name)]
    else:
        pairs = [(b, b.name or Path(b.path).resolve().name) for b in builds]
    seen: set[str] = set()
    for _, name in pairs:
        if name is not None and not _NAME.fullmatch(name):
            raise ConfigError(f"build name {name!r} is not a Triton model name (letters, digits, "
                              "_ . -); name it with --build NAME=DIR")
        if name in seen:
            raise ConfigError(f"two builds are named {name!r}; name them with --build NAME=DIR")
        seen.add(name)
    return pairs


def _served_names(builds: Sequence[_Build], names: Sequence[c.ModelNames]) -> list[str]:
    """The OpenAI model name each build is served under ("": its ensemble's, alone). The
    builds of one checkpoint, each of another workload (a chat and a video build), are one
    model named after the checkpoint's folder (the first such build's), and the gateway sends
    each request to the one that fits it (gateway/routing.py). One checkpoint by content
    (`_Build.checkpoint_key`), so builds of two checkpoints never share a name. A checkpoint's
    builds of one workload (an FP16 and an INT8 chat build to compare) are served apart."""
    groups: dict[str, list[int]] = {}
    for i, build in enumerate(builds):
        groups.setdefault(build.checkpoint_key, []).append(i)
    served = [""] * len(builds)
    taken = {n.ensemble for n in names}
    for members in groups.values():
        first: dict[Workload, int] = {}
        for i in members:
            first.setdefault(builds[i].workload, i)
        if len(first) == 1:
            continue
        name = builds[members[0]].checkpoint_name
        for i in members:
            if first[builds[i].workload] != i:
                raise ConfigError(
                    f"builds {names[first[builds[i].workload]].ensemble} and "
                    f"{names[i].ensemble} are both {builds[i].workload} builds of {name}, "
                    "whose builds of different workloads are served as one model, one build "
                    "per workload; leave one out or write it into a repository of its own")
        if name in taken:
            raise ConfigError(f"the builds {', '.join(names[i].ensemble for i in members)} of "
                              f"{name} would be served as the model {name!r}, the name of "
                              "another build or checkpoint too; rename that build "
                              "(--build NAME=DIR) or one checkpoint's folder")
        taken.add(name)
        for i in members:
            served[i] = name
        log.info("serving the builds %s as one model, %s", ", ".join(
            f"{names[i].ensemble} ({builds[i].workload})" for i in members), name)
    return served


# ---- one build ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Build:
    """What the repository reads from a build folder."""

    folder: BuildFolder
    manifest: Manifest
    checkpoint: Checkpoint
    profile: GpuProfile
    plan: Plan

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def checkpoint_name(self) -> str:
        return self.checkpoint.path.resolve().name

    @property
    def checkpoint_key(self) -> str:
        """The checkpoint by content: the manifest's file hashes (a build that lacks them
        stands alone: its own folder)."""
        hashes = self.manifest.inputs.get("checkpoint")
        return json.dumps(hashes, sort_keys=True) if hashes else str(self.path)

    @property
    def build_options(self) -> BuildOptions:
        return self.manifest.options

    @property
    def workload(self) -> Workload:
        return self.build_options.workload


def _open_build(path: Path) -> _Build:
    folder = BuildFolder(Path(path).resolve())
    manifest = folder.manifest()
    profile = folder.profile()
    options = manifest.options
    checkpoint = open_checkpoint(options.model, validate=False)
    # profile.json holds the limits the build planned and used: planning again keeps them.
    return _Build(folder, manifest, checkpoint, profile,
                  make_plan(checkpoint, profile, options.weights, options.tp_size,
                            options.workload))


def _emit_build(build: _Build, names: c.ModelNames, root: Path, options: RepoOptions,
                runtime: Path, *, kv_tokens: int, mount_root: Path, served_name: str) -> None:
    # The prompt table travels in the dtype the LLM step computes in, as numpy.
    llm_dtype = LLM_ENGINE_DTYPE if options.flavor is Flavor.TRT else Dtype(options.reference_dtype)
    if llm_dtype not in NUMPY_DTYPES:
        raise ConfigError(f"LLM dtype {llm_dtype} is not supported by the repository's python "
                          f"models, which move tensors as numpy ({', '.join(NUMPY_DTYPES)})")
    for name in names.all():
        if (root / name).exists():
            raise ConfigError(f"model {name} would be written twice; give the builds distinct "
                              "names with --build NAME=DIR")
    folders = {name: root / name / VERSION for name in names.all()}
    for folder in folders.values():
        folder.mkdir(parents=True)
    ckpt, lim = build.checkpoint, build.profile.limits

    pre = folders[names.preprocessing]
    _python_model(pre, c.PREPROCESSING, runtime)
    _copy_checkpoint_files(ckpt, pre / CHECKPOINT_DIR)

    vision = folders[names.vision_encoder]
    _python_model(vision, c.VISION_ENCODER, runtime)
    # The reference tower normalises the 8-bit pixels with the image processor settings.
    _copy_files(ckpt.path, vision / CHECKPOINT_DIR, ["config.json", "preprocessor_config.json"])
    llm = folders[names.tensorrt_llm]
    # Both flavors' tensorrt_llm read it: xgrammar's view of the tokenizer (guided decoding).
    TokenizerInfo.of_tokenizer(ckpt.path / TOKENIZER_JSON, ckpt.generation.end_ids).write(
        llm / TOKENIZER_INFO_NAME)
    if options.flavor is Flavor.TRT:
        _link_tree(build.folder.finished(build.folder.stage(Stage.VISION),
                                         "holds the vision engine"),
                   vision / ENGINE_DIR, only=(VISION_ENGINE_NAME, CONFIG_NAME))
        _link_tree(build.folder.finished(build.folder.llm_engine, "holds the LLM engine"),
                   llm / ENGINE_DIR)
    else:
        _write_vision_weights(ckpt, vision / CHECKPOINT_DIR / VISION_WEIGHTS_NAME)
        _python_model(llm, c.TENSORRT_LLM, runtime)
        _link_tree(build.folder.finished(build.folder.llm_checkpoint,
                                         "holds the converted LLM checkpoint"),
                   llm / CHECKPOINT_DIR)
        # The build config the trt flavor's engine gets for this profile: the stand-in reads
        # its limits as the executor reads the engine's config.json.
        write_json_atomic(llm / BUILD_CONFIG_NAME, engine_build_config(
            build.profile, deepstack_layers=ckpt.vision.deepstack_count,
            weights=build.plan.weights))

    post = folders[names.postprocessing]
    _python_model(post, c.POSTPROCESSING, runtime)
    _copy_files(ckpt.path, post, [TOKENIZER_JSON])
    bls = folders[names.tensorrt_llm_bls]
    _python_model(bls, c.TENSORRT_LLM_BLS, runtime)
    _copy_files(ckpt.path, bls, [TOKENIZER_JSON])

    settings = StepSettings(
        names=names, flavor=options.flavor, max_batch_size=lim.max_batch_size,
        hidden_size=ckpt.text.hidden_size, patch_dim=ckpt.vision.patch_dim,
        table_dtype=llm_dtype.triton, mrope=MropeTable.of(ckpt.text, lim.max_seq_len),
        engine_dir=str(mount_root / names.tensorrt_llm / VERSION / ENGINE_DIR),
        tokenizer_info_path=str(mount_root / names.tensorrt_llm / VERSION / TOKENIZER_INFO_NAME),
        kv_cache_free_gpu_mem_fraction=lim.kv_cache_free_gpu_mem_fraction,
        max_tokens_in_paged_kv_cache=kv_tokens,
        preprocessing_instances=options.preprocessing_instances,
        postprocessing_instances=options.postprocessing_instances,
        max_queue=options.queue_for(lim.max_batch_size),
        max_queue_wait_s=options.max_queue_wait_s,
        parameters=_python_parameters(build, options, served_name),
    )
    for name, config in step_configs(settings).items():
        write_config(config, root / name)
    write_json_atomic(folders[names.ensemble] / BUILD_INFO,
                      to_jsonable(_build_info(build, options, names, kv_tokens)))


def preprocessing_parameters(profile: GpuProfile, options: RepoOptions,
                             checkpoint_name: str = "", served_name: str = "",
                             cache_key: str = "") -> c.PreprocessingParameters:
    """The preprocessing model's parameters for a profile (scripts/bench_preprocess.py runs the
    model's code with them)."""
    lim = profile.limits
    return c.PreprocessingParameters(
        max_images=lim.max_images_per_request, max_input_len=lim.max_input_len,
        max_seq_len=lim.max_seq_len, min_pixels=lim.vision_min_pixels,
        max_pixels=lim.vision_max_pixels, max_visual_tokens=lim.max_visual_tokens_per_request,
        default_max_tokens=options.default_max_tokens,
        image_url_allow_list=",".join(options.image_url_allow_list),
        checkpoint_name=checkpoint_name, served_name=served_name, cache_key=cache_key,
        **asdict(RequestBounds()), **asdict(RequestLimits.from_profile(profile).video))


def _python_parameters(build: _Build, options: RepoOptions,
                       served_name: str) -> dict[str, c.ModelParameters]:
    parameters: dict[str, c.ModelParameters] = {
        c.PREPROCESSING: preprocessing_parameters(build.profile, options,
                                                  build.checkpoint_name, served_name,
                                                  build.manifest.cache_key),
        c.VISION_ENCODER: c.VisionEncoderParameters(
            flavor=options.flavor, device=options.device, dtype=options.reference_dtype,
            cache_bytes=options.vision_cache_mib * 2**20),
    }
    if options.flavor is Flavor.REFERENCE:
        parameters[c.TENSORRT_LLM] = c.ReferenceLlmParameters(
            device=options.device, dtype=options.reference_dtype,
            prompt_table_rows_per_request=build.plan.prompt_table_rows_per_request,
            cancellation_check_period_ms=CANCELLATION_CHECK_PERIOD_MS,
            guided_decoding_backend=GUIDED_DECODING_BACKEND,
            xgrammar_tokenizer_info_path=TOKENIZER_INFO_NAME,
            enable_chunked_context=ENABLE_CHUNKED_CONTEXT,
            enable_kv_cache_reuse=ENABLE_KV_CACHE_REUSE)
    return parameters


def _build_info(build: _Build, options: RepoOptions, names: c.ModelNames,
                kv_tokens: int) -> BuildInfo:
    return BuildInfo(
        qvl_trt=__version__,
        flavor=options.flavor,
        cache_key=build.manifest.cache_key,
        models=names,
        profile=build.profile,
        llm_dtype=LLM_ENGINE_DTYPE.value,
        vision_dtype=build.build_options.vision_dtype.value,
        tp_size=build.build_options.tp_size,
        trt_edition=build.build_options.trt_edition or build.profile.gpu.trt_edition,
        kv_cache_tokens=kv_tokens,
        prompt_table_rows=build.plan.prompt_table_rows,
        shm_bytes=build.plan.shm_bytes,
        weights=build.plan.weights,
    )


# ---- files ----------------------------------------------------------------------------------

def _python_model(folder: Path, step: str, runtime: Path) -> None:
    template = data_dir("triton_repo") / step / VERSION / MODEL_PY
    shutil.copyfile(template, folder / MODEL_PY)
    _link(runtime, folder / RUNTIME_ZIP)


def _copy_checkpoint_files(ckpt: Checkpoint, dest: Path) -> None:
    _copy_files(ckpt.path, dest, ckpt.preprocessing_files)


def _copy_files(src: Path, dest: Path, names: Sequence[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (src / name).is_file():
            raise BuildError(f"{src / name} is missing; the checkpoint is incomplete")
        shutil.copyfile(src / name, dest / name)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links unsupported
        shutil.copyfile(src, dst)


def _link_tree(src: Path, dest: Path, *, only: Sequence[str] | None = None) -> None:
    """Link the files of a stage folder (`only` those) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    files = [src / n for n in only] if only else sorted(p for p in src.iterdir() if p.is_file())
    for path in files:
        if not path.is_file():
            raise BuildError(f"{path} is missing; rebuild that stage with `qvl-trt build "
                             "--resume BUILD --force --only STAGE`")
        _link(path, dest / path.name)


def _write_vision_weights(ckpt: Checkpoint, dest: Path) -> None:
    """The vision tower's tensors only (the reference vision_encoder loads them with the
    checkpoint's config.json beside them)."""
    from ..deps import require

    safetensors_torch = require("safetensors.torch", extra="export",
                                why="write the reference vision weights")
    tensors = {name: ckpt.load(name).contiguous() for name in ckpt.tensors
               if name.startswith(VISION_PREFIX)}
    if not tensors:
        raise BuildError(f"{ckpt.path} holds no vision weights ({VISION_PREFIX}*); the reference "
                         "flavor needs the full checkpoint")
    safetensors_torch.save_file(tensors, str(dest), {"format": "pt"})


def write_runtime_zip(dest: Path) -> Path:
    """A zip of the installed qvl_trt package (Python sources only) that a python model adds
    to sys.path. Entries have fixed timestamps, so equal sources give an identical file."""
    package = Path(__file__).resolve().parents[1]
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(package.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            arcname = f"qvl_trt/{path.relative_to(package).as_posix()}"
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    return dest
