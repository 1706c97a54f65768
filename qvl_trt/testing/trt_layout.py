"""trt-flavor repositories without TensorRT-LLM: the LLM engine folder laid out as
TensorRT-LLM writes it, around a placeholder engine (validate, serve plans, image recipes and
manifests read only those files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..manifest import CONFIG_NAME, VISION_ENGINE_NAME, BuildFolder, Stage
from ..triton.layout import ENGINE_DIR, VERSION


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of the folder `src` made of hard links (the fixtures' builds are read-only)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def write_llm_engine_layout(build: Path) -> None:
    """An LLM engine folder laid out as TensorRT-LLM 1.2's `engine.save` writes it: config.json
    (pretrained_config: the converted checkpoint's config; build_config: what the llm stage
    builds with) and one rank file per TP rank. TensorRT-LLM does not install here; validate
    reads only these files, never the engine bytes, so the rank file holds a marker."""
    from ..llm.engine import engine_build_config
    from ..profiles import load_profile

    folder = BuildFolder(build)
    options = folder.manifest().options
    pretrained = json.loads((folder.llm_checkpoint / CONFIG_NAME).read_text())
    settings = engine_build_config(load_profile(options.gpu),
                                   deepstack_layers=pretrained["num_deepstack_layers"],
                                   weights=options.weights)
    engine = folder.llm_engine
    engine.mkdir(parents=True)
    (engine / CONFIG_NAME).write_text(json.dumps(
        {"version": "1.2.1", "pretrained_config": pretrained, "build_config": settings}))
    for rank in range(pretrained["mapping"]["world_size"]):
        (engine / f"rank{rank}.engine").write_bytes(
            b"TensorRT-LLM engine placeholder (not loadable)")


def write_vision_engine_layout(build: Path, edition: str) -> None:
    """The vision stage's engine and the config.json naming its TensorRT edition, around a
    placeholder engine: for a profile whose edition cannot build here (full TensorRT)."""
    vision = BuildFolder(build).stage(Stage.VISION)
    vision.mkdir()
    (vision / VISION_ENGINE_NAME).write_bytes(b"vision engine placeholder (not loadable)")
    (vision / CONFIG_NAME).write_text(json.dumps({"edition": edition}))


def trt_repo_of(build: Path, root: Path) -> Path:
    """The trt repository of a copy of `build` (which has its vision engine) in `root`."""
    from ..triton.repository import BuildInput, write_repo

    copy = linked_copy(build, root / "build")
    write_llm_engine_layout(copy)
    return write_repo([BuildInput(copy)], root / "repo").path


def as_datacenter_vision(repo: Path) -> Path:
    """Mark the repository's vision engine as a full-TensorRT one (a data-center profile's
    edition; TensorRT-RTX built the bytes, which no check here loads)."""
    for config in repo.glob(f"*/{VERSION}/{ENGINE_DIR}/{CONFIG_NAME}"):
        data = json.loads(config.read_text())
        if "edition" in data:
            data["edition"] = "tensorrt"
            config.unlink()  # a hard link into the build: write a file of its own
            config.write_text(json.dumps(data))
    return repo
