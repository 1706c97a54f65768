"""Validate an exported vision graph against the Hugging Face vision tower.

For each image size, the ONNX graph (onnxruntime) gets random uint8 pixels + the host index
tensors; the HF tower (fp32, from the checkpoint's own config and weights) gets the float
pixels HF's processor makes of them + grid_thw. Per output, the worst `max|diff| /
max|reference|` over the sizes must stay within the dtype's tolerance. A shape mismatch is
always an error.

The vision build stage exports and validates in a child process (`python -m
qvl_trt.vision.validate export_config.json`, the protocol of qvl_trt/child.py): torch keeps
the traced graph's tensors alive after an export (the build process stayed at 1.4 GiB after
exporting and validating the 2B tower, 0.4 GiB of it imported libraries), and none of it may
sit in the build process while the engine child builds. The child leaves `export.log` and
`reproduce_export.sh` beside its config.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_json_atomic
from ..checkpoint import VISION_PREFIX, Checkpoint, open_checkpoint
from ..child import child_main, run_module_child
from ..deps import require
from ..dtypes import Dtype
from ..errors import BuildError, ConfigError
from ..manifest import EXPORT_CONFIG_NAME, EXPORT_LOG_NAME, EXPORT_REPRODUCE_NAME, VALIDATION_NAME
from ..mm.pixels import PixelConfig
from ..profiles import TrtEdition
from ..typed_config import load_dataclass, to_jsonable
from .export import check_onnx_io, export_vision_onnx
from .spec import vision_graph_spec

# A fixed name: the child runs this module as __main__.
log = logging.getLogger("qvl_trt.vision.validate")

_EXPORT_RESULT_NAME = "export_result.json"  # the child's seconds, read and removed

# max|diff| / max|reference| per output, vs the fp32 HF tower.
TOLERANCES = {Dtype.FLOAT32: 1e-5, Dtype.FLOAT16: 1e-2, Dtype.BFLOAT16: 5e-2}
# Patch grids (1, h, w) checked: square, wide, tall, odd block counts; none is the traced
# 16x16 grid except one, so a graph frozen at the traced size fails.
DEFAULT_GRIDS = ((1, 16, 16), (1, 8, 12), (1, 30, 4), (1, 14, 22), (1, 2, 26), (1, 36, 36))
# After an export (build stage, export-vision): two small sizes, wide and tall, neither the
# traced one. Each costs one run of each side, and the cost of a validation is loading the
# two towers, not running them: larger images would add time, not coverage.
QUICK_GRIDS = ((1, 4, 6), (1, 8, 2))


@dataclass(frozen=True)
class OutputCheck:
    name: str
    max_abs_diff: float
    max_abs_ref: float
    tolerance: float
    worst_grid: tuple[int, int, int]

    @property
    def relative(self) -> float:
        return self.max_abs_diff / max(self.max_abs_ref, 1e-30)

    @property
    def passed(self) -> bool:
        return self.relative <= self.tolerance

    def line(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        h, w = self.worst_grid[1:]
        return (f"{self.name:<13} max|diff| {self.max_abs_diff:.3e}  max|ref| "
                f"{self.max_abs_ref:.3e}  ratio {self.relative:.2e} <= {self.tolerance:.0e}  "
                f"{mark} (worst at {h}x{w} patches)")


@dataclass(frozen=True)
class VisionValidation:
    graph: str  # what was checked, e.g. "model.onnx (float16, onnxruntime)"
    grids: tuple[tuple[int, int, int], ...]
    checks: tuple[OutputCheck, ...]
    seconds: float = 0.0  # wall time of the comparison

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]

    def raise_if_failed(self) -> None:
        if not self.passed:
            failed = ", ".join(c.name for c in self.checks if not c.passed)
            raise BuildError(
                f"{self.graph} differs from the Hugging Face vision tower beyond tolerance "
                f"({failed}): " + "; ".join(self.lines()) + ". With bfloat16 weights that "
                "overflow fp16, export with --vision-dtype bfloat16")


Runner = Callable[[tuple], Sequence[np.ndarray]]


def validate_vision_onnx(onnx_path: Path, ckpt: Checkpoint, *, dtype: Dtype | str,
                         grids: Sequence[tuple[int, int, int]] = DEFAULT_GRIDS,
                         reference=None) -> VisionValidation:
    """Compare the ONNX graph at `onnx_path` (exported in `dtype`) with the HF vision tower
    `reference` (default: built from the checkpoint). bfloat16 graphs cannot run on
    onnxruntime's CPU kernels; for them the PyTorch module that was exported is compared
    instead."""
    check_onnx_io(Path(onnx_path), vision_graph_spec(ckpt.vision, dtype))
    # The runner is handed over without a name here, so compare_with_hf can free it.
    if Dtype(dtype) is Dtype.BFLOAT16:
        return compare_with_hf(_torch_runner(ckpt, Dtype.BFLOAT16), ckpt, dtype=dtype,
                               graph=f"{Path(onnx_path).name} (bfloat16, PyTorch)",
                               grids=grids, reference=reference)
    return compare_with_hf(_onnx_runner(onnx_path), ckpt, dtype=dtype,
                           graph=f"{Path(onnx_path).name} ({dtype}, onnxruntime)",
                           grids=grids, reference=reference)


def compare_with_hf(run: Runner, ckpt: Checkpoint, *, dtype: Dtype | str, graph: str,
                    grids: Sequence[tuple[int, int, int]], reference=None) -> VisionValidation:
    """Run `run(inputs)` (inputs as the spec orders them, torch CPU tensors; returns the
    spec's outputs) and the HF tower on each grid, and check every output. The graph runs
    on every grid first and is dropped (this function holds the only reference the callers
    here pass it) before the HF tower is loaded: the two are never in memory together."""
    torch = require("torch", extra="export", why="validate the vision export")
    from .tower import example_inputs

    started = time.perf_counter()
    spec = vision_graph_spec(ckpt.vision, dtype)
    pixels = PixelConfig.of_checkpoint(ckpt)
    cases = [example_inputs(ckpt, tuple(grid), seed=sum(grid)) for grid in grids]
    outputs = [[np.asarray(o, dtype=np.float32) for o in run(inputs)] for inputs in cases]
    del run
    gc.collect()
    reference = reference if reference is not None else hf_vision_tower(ckpt)
    worst: dict[str, tuple[float, float, float, tuple[int, int, int]]] = {}
    for grid, inputs, outs in zip(grids, cases, outputs, strict=True):
        hf_pixels = torch.from_numpy(pixels.normalise(inputs[0].numpy()))
        with torch.no_grad():
            hf = reference(hf_pixels, grid_thw=torch.tensor([grid]))
        refs = [hf.pooler_output, *hf.deepstack_features]
        if len(outs) != len(refs):
            raise BuildError(f"{graph} returned {len(outs)} outputs, the HF tower "
                             f"{len(refs)}; re-export with this qvl-trt version")
        for tensor, out, ref in zip(spec.outputs, outs, refs, strict=True):
            ref = ref.float().numpy()
            if out.shape != ref.shape:
                raise BuildError(f"{graph}: {tensor.name} has shape {out.shape} for grid "
                                 f"{grid}, the HF tower {ref.shape}")
            diff, peak = float(np.abs(out - ref).max()), float(np.abs(ref).max())
            if tensor.name not in worst or diff / peak > worst[tensor.name][0]:
                worst[tensor.name] = (diff / peak, diff, peak, tuple(grid))
    checks = tuple(OutputCheck(t.name, worst[t.name][1], worst[t.name][2], TOLERANCES[Dtype(dtype)],
                               worst[t.name][3]) for t in spec.outputs)
    result = VisionValidation(graph, tuple(tuple(g) for g in grids), checks,
                              time.perf_counter() - started)
    for line in result.lines():
        log.debug("validate %s: %s", graph, line)
    return result


def hf_vision_tower(ckpt: Checkpoint):
    """The transformers vision tower (`Qwen3VLVisionModel`, fp32) with the checkpoint's
    vision weights, loaded without the language model."""
    torch = require("torch", extra="export", why="validate the vision export")
    transformers = require("transformers", extra="export", why="validate the vision export")
    # deepcopy: the config class rewrites the nested dicts it is given.
    config = transformers.Qwen3VLConfig(**copy.deepcopy(ckpt.config)).vision_config
    with _skip_random_init():
        model = transformers.Qwen3VLVisionModel._from_config(config).float()
    # Copied in tensor by tensor, as each is read: no second fp32 copy of the tower.
    targets = model.state_dict()
    names = sorted(n[len(VISION_PREFIX):] for n in ckpt.tensors if n.startswith(VISION_PREFIX))
    if names != sorted(targets):
        missing, extra = sorted(set(targets) - set(names)), sorted(set(names) - set(targets))
        raise BuildError(f"the checkpoint's vision tensors do not match transformers' "
                         f"Qwen3VLVisionModel (missing {missing[:3]}, unexpected {extra[:3]}); "
                         "upgrade transformers or re-download the checkpoint")
    with torch.no_grad():
        for name in names:
            tensor = ckpt.load(VISION_PREFIX + name)
            if tensor.shape != targets[name].shape:  # copy_ would broadcast
                raise BuildError(f"{VISION_PREFIX + name} has shape {list(tensor.shape)}, "
                                 f"transformers' vision tower {list(targets[name].shape)}; "
                                 "the config does not belong to these weights")
            targets[name].copy_(tensor)
    return model.eval().requires_grad_(False)


def _skip_random_init():
    """transformers' no_init_weights (5.x: transformers.initialization, 4.57:
    transformers.modeling_utils): the weights are loaded right after, and initialising the
    2B tower at random first takes ~15 s of CPU."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _onnx_runner(onnx_path: Path) -> Runner:
    ort = require("onnxruntime", extra="export", why="validate the vision export")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 graphs make onnxruntime warn about inserted casts
    # Few runs on small images: no arena kept at its peak, and no constant folding of the
    # casts onnxruntime inserts around fp16 weights (it would hold an fp32 copy of them).
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(inputs: tuple) -> Sequence[np.ndarray]:
        return session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})

    return run


def _torch_runner(ckpt: Checkpoint, dtype: Dtype) -> Runner:
    torch = require("torch", extra="export", why="validate the vision export")
    from .tower import load_vision_tower

    tower = load_vision_tower(ckpt, dtype)

    def run(inputs: tuple) -> Sequence[np.ndarray]:
        with torch.no_grad():
            return [o.float().numpy() for o in tower(*inputs)]

    return run


def export_and_validate(ckpt: Checkpoint, out: Path, *, dtype: Dtype | str = Dtype.FLOAT16,
                        edition: TrtEdition = TrtEdition.TENSORRT_RTX,
                        inputs: dict[str, Any] | None = None):
    """Export (as `export_vision_onnx`), then compare the graph with the Hugging Face tower on
    a few image sizes; the result is also written to `out/validation.txt`. Returns
    (VisionOnnx, VisionValidation); the caller decides what a failure means."""
    onnx = export_vision_onnx(ckpt, out, dtype=dtype, edition=edition, inputs=inputs)
    validation = validate_vision_onnx(onnx.path, ckpt, dtype=dtype, grids=QUICK_GRIDS)
    (Path(out) / VALIDATION_NAME).write_text("\n".join(validation.lines()) + "\n")
    return onnx, validation


@dataclass(frozen=True)
class ExportConfig:
    """What the export child reads (export_config.json)."""

    checkpoint: str  # the checkpoint folder
    out: str  # the export folder to create, relative to the config's folder
    dtype: Dtype
    edition: TrtEdition
    inputs: dict[str, Any]  # `export_inputs`, recorded in onnx.json


@dataclass(frozen=True)
class ExportTimes:
    export_seconds: float
    validate_seconds: float


def export_and_validate_in_child(folder: Path, config: ExportConfig) -> ExportTimes:
    """`export_and_validate` in a child process, its files in `folder`: a failed export or
    validation, a crash or an out-of-memory kill is a BuildError naming the log and
    reproduce_export.sh."""
    log.info("exporting and validating the vision tower in a child process")
    run_module_child(
        folder, "qvl_trt.vision.validate", config, config_name=EXPORT_CONFIG_NAME,
        log_name=EXPORT_LOG_NAME, reproduce_name=EXPORT_REPRODUCE_NAME, what="vision export",
        comment=f"Export the vision tower to {config.out}/ and validate it against Hugging "
        f"Face, as {EXPORT_CONFIG_NAME} says.\nNeeds qvl-trt[export].")
    result = Path(folder) / _EXPORT_RESULT_NAME
    times = load_dataclass(ExportTimes, json.loads(result.read_text()), str(result))
    result.unlink()
    return times


def _main(argv: list[str]) -> None:
    """Child entry point: export and validate as an export_config.json says."""
    if len(argv) != 1:
        raise ConfigError(f"usage: python -m qvl_trt.vision.validate {EXPORT_CONFIG_NAME}")
    path = Path(argv[0]).resolve()
    config = load_dataclass(ExportConfig, json.loads(path.read_text()), str(path))
    onnx, validation = export_and_validate(
        open_checkpoint(config.checkpoint, validate=False), path.parent / config.out,
        dtype=config.dtype, edition=config.edition, inputs=config.inputs)
    write_json_atomic(path.parent / _EXPORT_RESULT_NAME,
                      to_jsonable(ExportTimes(onnx.seconds, validation.seconds)))
    for line in validation.lines():
        log.info("  %s", line)
    validation.raise_if_failed()


if __name__ == "__main__":
    sys.exit(child_main(_main))
