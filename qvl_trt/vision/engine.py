"""Build the vision engine from its ONNX graph with either TensorRT edition.

One builder for both: `tensorrt` (data-center cards; builds for the GPU it runs on) and
TensorRT-RTX (GeForce/RTX cards; builds ahead of time for listed compute capabilities, no GPU
needed). Networks are strongly typed: precision comes from the graph, so neither edition
gets a precision flag.

The build runs in a child process (`python -m qvl_trt.vision.engine build_config.json`,
the protocol of qvl_trt/child.py), so a crash or an out-of-memory kill becomes a BuildError
and the memory is returned. Beside the engine it leaves `build_config.json` (the resolved
settings), `build.log` (the child's output, TensorRT's log routed through Python logging)
and `reproduce.sh` (re-runs that same child command), `config.json`, which the runner
reads. Full TensorRT also leaves `timing.cache`, its tactic timings: a build whose folder
already holds one (the vision stage copies the previous engine's) starts from it, so that a
rebuild picks the tactics the last one picked instead of timing them afresh. TensorRT-RTX
builds ahead of time without timing tactics and has no timing cache (its bindings warn "Timing
cache operations are no-ops in TensorRT-RTX" since 1.2). Neither edition promises equal
engine bytes (TensorRT-RTX 1.7 orders the plan's I/O tensor records differently between
builds; qvl_trt.manifest marks the engine as varying). config.json holds no times or paths
(the build's seconds and memory are in build.log): equal inputs give an equal file.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import staged_file, write_json_atomic
from ..child import REPRODUCE_NAME, child_main, run_module_child
from ..deps import available, require
from ..dtypes import Dtype
from ..errors import BuildError, ConfigError, StageUnavailable
from ..hashing import FileHasher
from ..manifest import (
    BUILD_CONFIG_NAME,
    BUILD_LOG_NAME,
    CONFIG_NAME,
    TIMING_CACHE_NAME,
    VISION_ENGINE_NAME,
)
from ..profiles import TrtEdition, sm_digits
from ..typed_config import load_dataclass, to_jsonable
from .spec import GraphSpec, GraphTensor, PatchRange, check_uint8_input

# Fixed names: the child runs this module as __main__.
log = logging.getLogger("qvl_trt.vision.engine")
trt_log = logging.getLogger("qvl_trt.vision.tensorrt")

EDITION_NAMES = {TrtEdition.TENSORRT: "TensorRT", TrtEdition.TENSORRT_RTX: "TensorRT-RTX"}


@dataclass(frozen=True)
class EngineBuildConfig:
    """Everything an engine build reads besides the ONNX graph (build_config.json)."""

    edition: TrtEdition
    dtype: Dtype
    onnx: str  # relative to the folder holding build_config.json
    compute_capabilities: tuple[str, ...]  # e.g. ("8.9",)
    patches: PatchRange
    builder_optimization_level: int
    workspace_gib: float
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]
    sources: dict[str, Any]  # what the ONNX was made from (hashes), copied to config.json


def trt_module(edition: TrtEdition):
    """The TensorRT Python module of `edition`. TensorRT-RTX installs from PyPI as
    `tensorrt_rtx_bindings`; NVIDIA's documentation imports it as `tensorrt_rtx`."""
    if edition is TrtEdition.TENSORRT:
        return require("tensorrt", extra="trtllm",
                       why="build or run the vision engine with full TensorRT (data-center "
                       "GPUs; NGC TensorRT-LLM container)")
    if available("tensorrt_rtx"):
        return require("tensorrt_rtx", extra="rtx", why="build or run the vision engine")
    return require("tensorrt_rtx_bindings", extra="rtx",
                   why="build or run the vision engine with TensorRT-RTX")


def check_edition_here(edition: TrtEdition, compute_capabilities: tuple[str, ...],
                       resume_hint: Callable[[], str]) -> None:
    """Raise unless this machine can build for `edition` and these compute capabilities
    (checked before the export, so no work is wasted). `resume_hint` gives the command that
    finishes the build elsewhere (it writes the image recipe: only called when needed)."""
    if edition is TrtEdition.TENSORRT_RTX:
        trt = trt_module(edition)
        for cc in compute_capabilities:
            if not hasattr(trt.ComputeCapability, _sm(cc)):
                supported = ", ".join(f"{int(m.value) // 10}.{int(m.value) % 10}"
                                      for n, m in trt.ComputeCapability.__members__.items()
                                      if n.startswith("SM"))
                raise ConfigError(
                    f"TensorRT-RTX {trt.__version__} cannot build for compute capability {cc} "
                    f"(it supports {supported}); use --trt-edition tensorrt for this GPU")
        return
    from ..machine import detect_gpus

    if not available("tensorrt"):
        raise StageUnavailable(
            "the vision engine for this profile needs full TensorRT (data-center edition), "
            f"which is not installed here; finish the build in the NGC TensorRT-LLM container "
            f"on a GPU of compute capability {'/'.join(compute_capabilities)}: {resume_hint()}")
    ccs = {g.compute_capability for g in detect_gpus()}
    if not ccs & set(compute_capabilities):
        raise StageUnavailable(
            "full TensorRT builds the vision engine on the target GPU, and this machine has "
            f"no GPU of compute capability {'/'.join(compute_capabilities)} (found: "
            f"{', '.join(sorted(ccs)) or 'none'}); finish on such a machine: {resume_hint()}")


def build_vision_engine(folder: Path, config: EngineBuildConfig) -> dict[str, Any]:
    """Build `folder/model.engine` from `folder/<config.onnx>` in a child process; write the
    build files beside it; return the engine's config.json."""
    log.info("building the vision engine (%s, %s, compute capability %s) in a child process",
             config.edition.value, config.dtype, "/".join(config.compute_capabilities))
    started = time.perf_counter()
    run_module_child(
        folder, "qvl_trt.vision.engine", config, config_name=BUILD_CONFIG_NAME,
        log_name=BUILD_LOG_NAME, reproduce_name=REPRODUCE_NAME, what="vision engine build",
        comment=f"Rebuild {VISION_ENGINE_NAME} from {config.onnx} with the settings in "
        f"{BUILD_CONFIG_NAME}.\nNeeds qvl-trt and the TensorRT edition named in it.")
    log.info("vision engine built in %.1f s", time.perf_counter() - started)
    return read_engine_config(folder)


def read_engine_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file() or not (Path(folder) / VISION_ENGINE_NAME).is_file():
        raise BuildError(f"{folder} holds no vision engine ({VISION_ENGINE_NAME} + {CONFIG_NAME}); "
                         "build it with `qvl-trt build --only vision`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BuildError(f"{path} is corrupt ({exc}); rebuild with `qvl-trt build --only "
                         "vision --force`") from None


# ---- the child process ---------------------------------------------------------------------

def make_trt_logger(trt):
    """A TensorRT ILogger that hands every message to Python logging."""
    levels = {trt.ILogger.Severity.INTERNAL_ERROR: logging.CRITICAL,
              trt.ILogger.Severity.ERROR: logging.ERROR,
              trt.ILogger.Severity.WARNING: logging.WARNING,
              trt.ILogger.Severity.INFO: logging.INFO,
              trt.ILogger.Severity.VERBOSE: logging.DEBUG}

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg: str) -> None:
            level = levels.get(severity, logging.INFO)
            if level >= logging.ERROR:
                self.errors.append(msg)
            if trt_log.isEnabledFor(level):
                trt_log.log(level, "%s", msg)

    return Logger()


def _sm(cc: str) -> str:
    """TensorRT-RTX's ComputeCapability member for `cc` ("8.9" -> SM89)."""
    return f"SM{sm_digits(cc)}"


def _build_in_this_process(folder: Path, config: EngineBuildConfig) -> None:
    trt = trt_module(config.edition)
    name = f"{EDITION_NAMES[config.edition]} {trt.__version__}"
    started = time.perf_counter()
    if config.edition is TrtEdition.TENSORRT:
        _check_current_gpu(config.compute_capabilities)
    logger = make_trt_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    onnx_path = folder / config.onnx
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(min(parser.num_errors, 5)))
        raise BuildError(f"{name} cannot parse {onnx_path}: {errors}")
    _check_uint8_inputs(trt, network, f"{name} network of {onnx_path}")
    builder_config = builder.create_builder_config()
    builder_config.builder_optimization_level = config.builder_optimization_level
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE,
                                         int(config.workspace_gib * 2**30))
    if config.edition is TrtEdition.TENSORRT_RTX:
        builder_config.num_compute_capabilities = len(config.compute_capabilities)
        for i, cc in enumerate(config.compute_capabilities):
            if not builder_config.set_compute_capability(getattr(trt.ComputeCapability,
                                                                 _sm(cc)), i):
                raise BuildError(f"TensorRT-RTX refused compute capability {cc}")
    profile = builder.create_optimization_profile()
    shapes = config.patches.input_shapes(GraphSpec(config.inputs, config.outputs))
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    builder_config.add_optimization_profile(profile)
    cache = (_attach_timing_cache(builder_config, folder / TIMING_CACHE_NAME)
             if config.edition is TrtEdition.TENSORRT else None)
    log.info("building: %s, optimisation level %d, workspace %.1f GiB, patches %d..%d (opt %d)",
             config.dtype, config.builder_optimization_level, config.workspace_gib,
             config.patches.min, config.patches.max, config.patches.opt)
    plan = builder.build_serialized_network(network, builder_config)
    if plan is None:
        raise BuildError(f"{name} could not build the engine: "
                         f"{' | '.join(logger.errors[-3:]) or 'no error logged'}")
    engine = folder / VISION_ENGINE_NAME
    with staged_file(engine) as f:
        f.write(plan)
    if cache is not None:
        with staged_file(folder / TIMING_CACHE_NAME) as f:
            f.write(cache.serialize())
    seconds = time.perf_counter() - started
    write_json_atomic(folder / CONFIG_NAME, {
        "edition": config.edition.value, "trt_version": trt.__version__,
        "compute_capabilities": list(config.compute_capabilities), "dtype": config.dtype,
        "inputs": to_jsonable(config.inputs), "outputs": to_jsonable(config.outputs),
        "patches": to_jsonable(config.patches), "shapes": to_jsonable(shapes),
        "builder_optimization_level": config.builder_optimization_level,
        "workspace_gib": config.workspace_gib,
        "sources": {**config.sources, "onnx": FileHasher().hash(onnx_path)},
        "engine_bytes": engine.stat().st_size,
    })
    log.info("wrote %s (%.1f MiB) in %.1f s, peak RSS %.0f MiB", VISION_ENGINE_NAME,
             engine.stat().st_size / 2**20, seconds,
             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _check_uint8_inputs(trt, network, where: str) -> None:
    """Hold the parsed network's uint8 inputs to full TensorRT's rule (check_uint8_input)
    with either edition: TensorRT-RTX alone would build more than full TensorRT does."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    for tensor in (network.get_input(i) for i in range(network.num_inputs)):
        if tensor.dtype != trt.uint8:
            continue
        uses: list[tuple[str, str | None]] = [("graph output", None)] * tensor.is_network_output
        for layer in layers:
            to = None
            if layer.type == trt.LayerType.CAST:
                out = layer.get_output(0).dtype
                to = next((d.value for d in Dtype if getattr(trt, d.value) == out),
                          out.name.lower())
            names = [t.name for t in map(layer.get_input, range(layer.num_inputs)) if t]
            uses += [("Cast" if to else layer.type.name, to)] * names.count(tensor.name)
        check_uint8_input(where, tensor.name, uses)


def _attach_timing_cache(builder_config, path: Path):
    """Give full TensorRT's builder the timing cache at `path` (a new one when there is none)
    and return it (IBuilderConfig.create_timing_cache: b"" makes a new cache;
    set_timing_cache(ignore_mismatch=False) refuses one of another device, so a stale cache
    costs a re-timing, never a wrong engine)."""
    data = path.read_bytes() if path.is_file() else b""
    cache = builder_config.create_timing_cache(data)
    if not builder_config.set_timing_cache(cache, ignore_mismatch=False):
        log.warning("%s does not match this builder; timing afresh", path.name)
        cache = builder_config.create_timing_cache(b"")
        builder_config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def _check_current_gpu(compute_capabilities: tuple[str, ...]) -> None:
    """Full TensorRT builds for the GPU it runs on: that GPU must be the target."""
    torch = require("torch", extra="export", why="read the GPU's compute capability")
    if not torch.cuda.is_available():
        raise StageUnavailable("full TensorRT needs the target GPU to build the vision engine "
                               "and CUDA sees none here")
    major, minor = torch.cuda.get_device_capability()
    if f"{major}.{minor}" not in compute_capabilities:
        raise StageUnavailable(
            f"this GPU ({torch.cuda.get_device_name()}) has compute capability "
            f"{major}.{minor}, the profile targets {'/'.join(compute_capabilities)}; build on "
            "a matching GPU (or pick it with CUDA_VISIBLE_DEVICES)")


def _main(argv: list[str]) -> None:
    """Child entry point: build the engine described by a build_config.json."""
    if len(argv) != 1:
        raise ConfigError(f"usage: python -m qvl_trt.vision.engine {BUILD_CONFIG_NAME}")
    path = Path(argv[0]).resolve()
    config = load_dataclass(EngineBuildConfig, json.loads(path.read_text()), str(path))
    _build_in_this_process(path.parent, config)


if __name__ == "__main__":
    sys.exit(child_main(_main))
