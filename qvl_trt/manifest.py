"""The build folder's format: its layout (the file names every stage writes, and
`BuildFolder`: one folder per stage, and the files later readers take from them), its options
(`BuildOptions`) and its manifest (`manifest.json`: the options, what each stage was built from
and what it wrote, so an unchanged stage is skipped and a build can be resumed elsewhere).
The stages' writers (vision/, llm/, build/) and its readers (the repository writer, serve)
take the names from here; nothing here imports them."""

from __future__ import annotations

import enum
import fnmatch
import json
import platform
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import write_json_atomic
from .child import write_reproduce
from .dtypes import LLM_ENGINE_DTYPE, VISION_ENGINE_DTYPES, Dtype, WeightOnly
from .errors import BuildError, ConfigError
from .hashing import fingerprint
from .profiles import GpuProfile, TrtEdition
from .typed_config import load_dataclass, to_jsonable
from .workload import Workload

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
PROFILE_NAME = "profile.json"  # in plan/: the resolved GPU profile
# The config.json of each engine or checkpoint folder: the vision engine's (which its runner
# reads), and TensorRT-LLM's in its checkpoint and its engine folder (engine.save writes it,
# tensorrt_llm/builder.py Engine.save; the executor reads it).
CONFIG_NAME = "config.json"
# Beside either engine: the resolved settings its child built with, and full TensorRT's
# tactic timings (a rebuild starts from the last ones).
BUILD_CONFIG_NAME = "build_config.json"
TIMING_CACHE_NAME = "timing.cache"
# vision/: the engine (with CONFIG_NAME), its build's log, the export's config, log and
# reproduce script, and the ONNX graph in its own folder with its metadata and validation.
VISION_ENGINE_NAME = "model.engine"
BUILD_LOG_NAME = "build.log"
EXPORT_CONFIG_NAME = "export_config.json"
EXPORT_LOG_NAME = "export.log"
EXPORT_REPRODUCE_NAME = "reproduce_export.sh"
ONNX_DIR = "onnx"
ONNX_NAME = "model.onnx"
ONNX_META_NAME = "onnx.json"
VALIDATION_NAME = "validation.txt"
VISION_FAILED_DIR = "vision.failed"  # the last failed engine build, beside the stage folders
# llm/: TensorRT-LLM's engine folder (CONFIG_NAME + rank{N}.engine).
LLM_ENGINE_DIR = "engine"
# The serving image recipe, written when the build must go on in it.
IMAGE_DIR = "image"


class Stage(str, enum.Enum):
    """The build's stages; each writes the folder of its name."""

    INSPECT = "inspect"
    PLAN = "plan"
    VISION = "vision"
    LLM_CHECKPOINT = "llm_checkpoint"
    LLM = "llm"
    REPO = "repo"
    MANIFEST = "manifest"

    @classmethod
    def parse_list(cls, text: str) -> tuple[Stage, ...]:
        """`--only vision,repo` -> (Stage.VISION, Stage.REPO)."""
        try:
            return tuple(cls(s.strip()) for s in text.split(",") if s.strip())
        except ValueError:
            raise ConfigError(
                f"--only {text!r}: stages are {', '.join(s.value for s in cls)}"
            ) from None


# Outputs that two builds of the same inputs are not expected to write byte-identically, by
# stage (patterns of their paths in the stage folder), and why; every other output is. A
# stage's record in the manifest names its own under "varies".
_VARIES: dict[Stage, dict[str, str]] = {
    Stage.PLAN: {"*": "names this machine's paths of the checkpoint and the profile file"},
    Stage.VISION: {
        BUILD_LOG_NAME: "the engine build's log: durations, memory, paths",
        EXPORT_LOG_NAME: "the export's log: durations, paths",
        EXPORT_CONFIG_NAME: "names the checkpoint's path",
        # Seen with TensorRT-RTX 1.7: ~170 bytes of 2.8 MB differ in the tiny engine, where
        # the plan lists its I/O tensors (in another order); same size, same config.json.
        VISION_ENGINE_NAME: "the builder serialises the engine's I/O tensor records in an "
                            "order that changes between builds",
    },
    Stage.LLM: {"*": "TensorRT-LLM builds with full TensorRT, which times tactics on the GPU "
                     "and may pick other ones in another build"},
    Stage.REPO: {"*/config.pbtxt": "may name absolute paths where the repository is mounted "
                                   "(the stock backend's gpt_model_path takes no relative one)"},
    Stage.MANIFEST: {"reproduce.sh": "names the checkpoint's path"},
}
# Full TensorRT also times tactics on the GPU: a rebuild starting from the last timing cache
# reuses its timings (and so its picks), which is no promise of equal bytes.
_FULL_TENSORRT_VARIES = {
    VISION_ENGINE_NAME: "full TensorRT picks tactics by timing them on this GPU",
    TIMING_CACHE_NAME: "gathers every build's tactic timings",
}


def varying_outputs(stage: Stage, outputs: dict[str, str],
                    edition: TrtEdition) -> dict[str, str]:
    """The outputs of `stage` (names as in its record) not expected byte-identical, with why."""
    rules = dict(_VARIES.get(stage, {}))
    if stage is Stage.VISION and edition is TrtEdition.TENSORRT:
        rules.update(_FULL_TENSORRT_VARIES)
    return {name: why for name in sorted(outputs)
            for pattern, why in rules.items() if fnmatch.fnmatch(name, pattern)}


@dataclass(frozen=True)
class BuildOptions:
    """Everything a build depends on besides the files it reads; stored in the manifest."""

    model: str
    gpu: str
    trt_edition: TrtEdition | None = None
    vision_dtype: Dtype = Dtype.FLOAT16
    tp_size: int = 1
    # The LLM's linear weights: in the engine dtype, or weight-only INT8/INT4.
    weights: WeightOnly = WeightOnly.NONE
    # What the limits are sized for (qvl_trt.workload): the planner derives them from it.
    workload: Workload = Workload.CHAT

    def __post_init__(self) -> None:
        if self.vision_dtype not in VISION_ENGINE_DTYPES:
            raise ConfigError(f"--vision-dtype {self.vision_dtype}: the engine takes "
                              f"{' or '.join(VISION_ENGINE_DTYPES)}")
        object.__setattr__(self, "vision_dtype", Dtype(self.vision_dtype))
        object.__setattr__(self, "weights", WeightOnly.parse(self.weights))
        object.__setattr__(self, "workload", Workload.parse(self.workload))

    def to_json(self) -> dict[str, Any]:
        data = to_jsonable(asdict(self))
        # Absent when the default, so the cache keys of builds made before the options are
        # unchanged.
        if self.weights is WeightOnly.NONE:
            del data["weights"]
        if self.workload is Workload.CHAT:
            del data["workload"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BuildOptions:
        """The options as `to_json` (or an earlier version) wrote them; a key it left out
        takes its default here."""
        data = dict(data)
        # Manifests of earlier versions record the LLM dtype, which no option could change.
        llm_dtype = data.pop("llm_dtype", LLM_ENGINE_DTYPE.value)
        if llm_dtype != LLM_ENGINE_DTYPE:
            raise ConfigError(f"the build's {MANIFEST_NAME} sets llm_dtype {llm_dtype!r}, but "
                              f"qvl-trt builds the language model in {LLM_ENGINE_DTYPE} only; "
                              "remove the key from its options, or start a new build folder")
        edition = data.pop("trt_edition", None)
        options = load_dataclass(cls, data, f"{MANIFEST_NAME} options")
        return replace(options, trt_edition=TrtEdition(edition) if edition else None)


@dataclass(frozen=True)
class BuildFolder:
    """Where a build folder (`qvl-trt build --out`) keeps what its readers take. Stage
    folders appear only when complete."""

    path: Path

    def stage(self, stage: Stage) -> Path:
        return self.path / stage.value

    @property
    def profile_file(self) -> Path:
        return self.stage(Stage.PLAN) / PROFILE_NAME

    @property
    def vision_engine(self) -> Path:
        return self.stage(Stage.VISION) / VISION_ENGINE_NAME

    @property
    def vision_config(self) -> Path:
        return self.stage(Stage.VISION) / CONFIG_NAME

    @property
    def llm_engine(self) -> Path:
        return self.stage(Stage.LLM) / LLM_ENGINE_DIR

    @property
    def llm_engine_config(self) -> Path:
        return self.llm_engine / CONFIG_NAME

    @property
    def llm_checkpoint(self) -> Path:
        return self.stage(Stage.LLM_CHECKPOINT)

    def manifest(self) -> Manifest:
        """The manifest, refusing a folder that has none."""
        manifest = Manifest.load(self.path)
        if manifest is None or manifest.options is None:
            raise BuildError(f"{self.path} is not a qvl-trt build folder (no {MANIFEST_NAME}); "
                             "build one with `qvl-trt build --model M --gpu G --out DIR`")
        return manifest

    def profile(self) -> GpuProfile:
        """The GPU profile the build was planned for (plan/profile.json)."""
        path = self.profile_file
        if not path.is_file():
            raise BuildError(f"{self.path} has no {path.relative_to(self.path)}; run "
                             f"`qvl-trt build --resume {self.path}`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BuildError(f"{path} is corrupt ({exc}); run `qvl-trt build --resume "
                             f"{self.path} --force --only plan`") from None
        return load_dataclass(GpuProfile, data, str(path))

    def finished(self, folder: Path, why: str) -> Path:
        """`folder` (a stage's output or a folder in it), which must exist because `why`."""
        if not folder.is_dir():
            raise BuildError(f"{self.path} has no {folder.relative_to(self.path)}/, which {why}; "
                             f"finish the build with `qvl-trt build --resume {self.path}` first")
        return folder


@dataclass
class Manifest:
    """Read and written as JSON; `stages` maps a stage name to its record. `options` is None
    until a build records its own."""

    options: BuildOptions | None = None
    # What the build as a whole is made from (checkpoint file hashes, profile, options) and
    # the cache key derived from it; see `build_inputs` in build/runner.py.
    inputs: dict[str, Any] = field(default_factory=dict)
    cache_key: str = ""
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    file_hashes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, build_dir: Path) -> Manifest | None:
        path = build_dir / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BuildError(
                f"{path} is corrupt ({exc}); delete {build_dir} and build again"
            ) from None
        if data.get("schema_version") != SCHEMA_VERSION:
            raise BuildError(
                f"{path} was written by another qvl-trt version (schema "
                f"{data.get('schema_version')}); build into a new folder"
            )
        return cls(
            options=BuildOptions.from_json(data["options"]) if data.get("options") else None,
            inputs=data.get("inputs", {}),
            cache_key=data.get("cache_key", ""),
            stages=data.get("stages", {}),
            tools=data.get("tools", {}),
            file_hashes=data.get("file_hashes", {}),
        )

    def save(self, build_dir: Path) -> None:
        data = {
            "schema_version": SCHEMA_VERSION,
            "qvl_trt": __version__,
            "options": self.options.to_json() if self.options else {},
            "inputs": self.inputs,
            "cache_key": self.cache_key,
            "tools": self.tools,
            "stages": self.stages,
            "file_hashes": self.file_hashes,
        }
        write_json_atomic(build_dir / MANIFEST_NAME, data)


def build_name(profile: str, weights: WeightOnly,
               workload: Workload = Workload.CHAT) -> str:
    """A build's profile, weight precision and workload in one name: `4090d` in the engine
    dtype for chat (the name builds had before the options, so their cache keys and folders
    stay), `4090d.int8` quantized, `h200.video` or `h200.int8.long` for another workload.
    Cache keys start with it and build folders are named after it. A '.', not a '-': the
    restore prefix of one name (`qvl-trt-4090d-`) must match no key of another
    (`qvl-trt-4090d.int8-...`)."""
    parts = [profile] + [str(o) for o in (weights, workload)
                         if o not in (WeightOnly.NONE, Workload.CHAT)]
    return ".".join(parts)


def cache_key(build_inputs: dict[str, Any]) -> str:
    """`qvl-trt-<build name>-<hash>`: the hash covers the build's inputs and the qvl-trt
    version; the prefix lets a CI cache restore the newest build of the same profile and
    weights, whose unchanged stages are then skipped."""
    digest = fingerprint({"inputs": build_inputs, "qvl_trt": __version__})
    # The options hold `weights` only when quantized, `workload` only when not chat
    # (BuildOptions.to_json).
    opts = build_inputs["options"]
    name = build_name(build_inputs["profile"]["name"],
                      WeightOnly(opts.get("weights", WeightOnly.NONE)),
                      Workload(opts.get("workload", Workload.CHAT)))
    return f"qvl-trt-{name}-{digest[:32]}"


def tool_versions() -> dict[str, Any]:
    """What a stage was built with: qvl-trt, Python, TensorRT editions, TensorRT-LLM, torch,
    transformers, CUDA, driver, GPUs (as `qvl-trt doctor` finds them)."""
    from .machine import cuda_version, detect_gpus, package_version

    gpus = detect_gpus()
    packages = ("tensorrt", "tensorrt_rtx", "tensorrt_llm", "torch", "transformers", "onnx")
    return {
        "qvl_trt": __version__,
        "python": platform.python_version(),
        **{name: package_version(name) for name in packages},
        "cuda": cuda_version(),
        "driver": gpus[0].driver if gpus else None,
        "gpus": [f"{g.name} (compute capability {g.compute_capability})" for g in gpus],
    }


def write_reproduce_script(manifest: Manifest, path: Path) -> Path:
    """Write the bash script that checks the checkpoint is the one this build read, then
    rebuilds with the same options (`MODEL`, `OUT` and extra `qvl-trt build` arguments override)."""
    opts = manifest.options
    tools = manifest.tools
    build = [
        "qvl-trt build",
        '--model "$MODEL"',
        f"--gpu {shlex.quote(opts.gpu)}",
        '--out "$OUT"',
        f"--vision-dtype {opts.vision_dtype}",
        f"--tp-size {opts.tp_size}",
    ]
    if opts.trt_edition:
        build.append(f"--trt-edition {opts.trt_edition.value}")
    if opts.weights is not WeightOnly.NONE:
        build.append(f"--weights {opts.weights}")
    if opts.workload is not Workload.CHAT:
        build.append(f"--workload {opts.workload}")
    used = ", ".join(
        f"{name} {tools[name]}"
        for name in ("tensorrt", "tensorrt_rtx", "tensorrt_llm", "cuda", "driver")
        if tools.get(name)
    )
    sums = "".join(f"{h}  {name}\n" for name, h in manifest.inputs["checkpoint"].items())
    default_out = f"reproduced-{manifest.inputs['profile']['name']}"
    # Run from where the user is: MODEL and OUT may be relative to it.
    return write_reproduce(path, [
        f"MODEL=${{MODEL:-{shlex.quote(opts.model)}}}",
        f"OUT=${{OUT:-{default_out}}}",
        f'if [ "$(qvl-trt --version)" != "qvl-trt {__version__}" ]; then',
        f'  echo "warning: this build was made by qvl-trt {__version__}" >&2',
        "fi",
        "# The checkpoint must be the one this build read.",
        "(cd \"$MODEL\" && sha256sum --check --quiet --strict) <<'EOF'",
        f"{sums}EOF",
        f'{" ".join(build)} "$@"',
    ], f"Rebuild of a qvl-trt {__version__} build (cache key {manifest.cache_key}).\n"
       f"Built with: {used or 'no TensorRT or TensorRT-LLM'}; "
       f"GPUs: {', '.join(tools.get('gpus') or []) or 'none'}.\n"
       "Usage: [MODEL=checkpoint] [OUT=folder] bash reproduce.sh [qvl-trt build options]",
       in_folder=False)
