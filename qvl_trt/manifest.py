"""The build folder's format: its layout (`BuildFolder`: one folder per stage, and the files
later readers take from them) and its manifest (`manifest.json`: what each stage was built
from and what it wrote, so an unchanged stage is skipped and a build can be resumed
elsewhere)."""

from __future__ import annotations

import enum
import fnmatch
import json
import platform
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import write_json_atomic
from .child import write_reproduce
from .dtypes import WeightOnly
from .errors import BuildError, ConfigError
from .hashing import fingerprint
from .llm.engine import ENGINE_CONFIG_NAME, ENGINE_DIR
from .profiles import GpuProfile, TrtEdition
from .typed_config import load_dataclass
from .vision.engine import BUILD_LOG_NAME, CONFIG_NAME, ENGINE_NAME, TIMING_CACHE_NAME
from .vision.validate import EXPORT_CONFIG_NAME, EXPORT_LOG_NAME
from .workload import Workload

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
PROFILE_NAME = "profile.json"  # in plan/: the resolved GPU profile
# The stages' output names, defined by the code that writes them.
VISION_ENGINE_NAME, VISION_CONFIG_NAME = ENGINE_NAME, CONFIG_NAME
LLM_ENGINE_DIR, LLM_ENGINE_CONFIG_NAME = ENGINE_DIR, ENGINE_CONFIG_NAME


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
        ENGINE_NAME: "the builder serialises the engine's I/O tensor records in an order that "
                     "changes between builds",
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
    ENGINE_NAME: "full TensorRT picks tactics by timing them on this GPU",
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
        return self.stage(Stage.VISION) / VISION_CONFIG_NAME

    @property
    def llm_engine(self) -> Path:
        return self.stage(Stage.LLM) / LLM_ENGINE_DIR

    @property
    def llm_engine_config(self) -> Path:
        return self.llm_engine / LLM_ENGINE_CONFIG_NAME

    @property
    def llm_checkpoint(self) -> Path:
        return self.stage(Stage.LLM_CHECKPOINT)

    def manifest(self) -> Manifest:
        """The manifest, refusing a folder that has none."""
        manifest = Manifest.load(self.path)
        if manifest is None or not manifest.options:
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
    """Read and written as JSON; `stages` maps a stage name to its record."""

    options: dict[str, Any] = field(default_factory=dict)
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
            options=data.get("options", {}),
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
            "options": self.options,
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
        f"--gpu {shlex.quote(opts['gpu'])}",
        '--out "$OUT"',
        f"--vision-dtype {shlex.quote(opts['vision_dtype'])}",
        f"--tp-size {int(opts['tp_size'])}",
    ]
    if opts.get("trt_edition"):
        build.append(f"--trt-edition {shlex.quote(opts['trt_edition'])}")
    if opts.get("weights"):
        build.append(f"--weights {shlex.quote(opts['weights'])}")
    if opts.get("workload"):
        build.append(f"--workload {shlex.quote(opts['workload'])}")
    used = ", ".join(
        f"{name} {tools[name]}"
        for name in ("tensorrt", "tensorrt_rtx", "tensorrt_llm", "cuda", "driver")
        if tools.get(name)
    )
    sums = "".join(f"{h}  {name}\n" for name, h in manifest.inputs["checkpoint"].items())
    default_out = f"reproduced-{manifest.inputs['profile']['name']}"
    # Run from where the user is: MODEL and OUT may be relative to it.
    return write_reproduce(path, [
        f"MODEL=${{MODEL:-{shlex.quote(opts['model'])}}}",
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
