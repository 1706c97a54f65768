"""The build manifest (`manifest.json` in a build folder): what each stage was built from and
what it wrote, so an unchanged stage is skipped and a build can be resumed elsewhere."""

from __future__ import annotations

import json
import platform
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import write_json_atomic
from .errors import BuildError
from .hashing import fingerprint

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1


@dataclass
class Manifest:
    """Read and written as JSON; `stages` maps a stage name to its record."""

    options: dict[str, Any] = field(default_factory=dict)
    # What the build as a whole is made from (checkpoint file hashes, profile, options) and
    # the cache key derived from it; see `build_inputs` in build.py.
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


def cache_key(build_inputs: dict[str, Any]) -> str:
    """`qvl-trt-<profile>-<hash>`: the hash covers the build's inputs and the qvl-trt
    version; the prefix lets a CI cache restore the newest build of the same profile, whose
    unchanged stages are then skipped."""
    digest = fingerprint({"inputs": build_inputs, "qvl_trt": __version__})
    return f"qvl-trt-{build_inputs['profile']['name']}-{digest[:32]}"


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


def reproduce_script(manifest: Manifest) -> str:
    """A bash script that checks the checkpoint is the one this build read, then rebuilds
    with the same options (`MODEL`, `OUT` and extra `qvl-trt build` arguments override)."""
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
    used = ", ".join(
        f"{name} {tools[name]}"
        for name in ("tensorrt", "tensorrt_rtx", "tensorrt_llm", "cuda", "driver")
        if tools.get(name)
    )
    sums = "".join(f"{h}  {name}\n" for name, h in manifest.inputs["checkpoint"].items())
    default_out = f"reproduced-{manifest.inputs['profile']['name']}"
    return (
        "#!/usr/bin/env bash\n"
        f"# Rebuild of a qvl-trt {__version__} build (cache key {manifest.cache_key}).\n"
        f"# Built with: {used or 'no TensorRT or TensorRT-LLM'}; "
        f"GPUs: {', '.join(tools.get('gpus') or []) or 'none'}.\n"
        "# Usage: [MODEL=checkpoint] [OUT=folder] bash reproduce.sh [qvl-trt build options]\n"
        "set -euo pipefail\n"
        f"MODEL=${{MODEL:-{shlex.quote(opts['model'])}}}\n"
        f"OUT=${{OUT:-{default_out}}}\n"
        f'if [ "$(qvl-trt --version)" != "qvl-trt {__version__}" ]; then\n'
        f'  echo "warning: this build was made by qvl-trt {__version__}" >&2\n'
        "fi\n"
        "# The checkpoint must be the one this build read.\n"
        "(cd \"$MODEL\" && sha256sum --check --quiet --strict) <<'EOF'\n"
        f"{sums}"
        "EOF\n"
        f'{" ".join(build)} "$@"\n'
    )
