"""Export the vision tower to ONNX with a dynamic patch count.

Layout of an export folder: `model.onnx` + `model.onnx.data` (external weights) +
`onnx.json` (dtype, opset, the TensorRT edition it is for, I/O spec, what it was exported
from).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import staged_dir, write_json_atomic
from ..checkpoint import VISION_PREFIX, Checkpoint
from ..deps import require
from ..dtypes import Dtype
from ..errors import BuildError
from ..hashing import fingerprint
from ..manifest import ONNX_META_NAME, ONNX_NAME
from ..mm.geometry import MIN_BLOCKS
from ..mm.pixels import PixelConfig
from ..profiles import TrtEdition
from ..typed_config import to_jsonable
from .spec import (
    MERGE_BLOCKS,
    PATCHES,
    UINT8_INPUT_CAST,
    GraphSpec,
    check_uint8_input,
    vision_graph_spec,
)

log = logging.getLogger(__name__)

# Attention in the graph: TensorRT-RTX 1.7 parses the ONNX `Attention` op (opset 23) into its
# fused attention layer. Full TensorRT parses that op from 10.14 ("Parsers: Added support for
# the Attention operator", TensorRT CHANGELOG 10.14), the release the TensorRT-LLM 1.2.1
# container carries (10.14.1.48). Its graph still keeps opset 18, where attention is
# MatMul-Softmax-MatMul (which TensorRT also fuses in fp16), until the opset-23 graph has been
# built and compared with full TensorRT on a GPU (tests/test_vision_gpu.py, whose full-TensorRT
# case exports with this table). Built with TensorRT-RTX at the 2B dims, the opset-23 graph
# takes ~25% less build time and 180 instead of 228 MiB of activations at 8192 patches
# (scripts/bench_vision_build.py --compare).
OPSETS = {TrtEdition.TENSORRT_RTX: 23, TrtEdition.TENSORRT: 18}
# The traced example: a 16x16-patch image. Any size works at run time (dynamic axis).
EXAMPLE_GRID = (1, 16, 16)

# TensorProto.DataType value -> the name TensorSpec.dtype uses (UINT8 = 2, INT32 = 6,
# INT64 = 7).
_ONNX_DTYPES = {**{d.onnx: d.value for d in Dtype}, 2: "uint8", 6: "int32", 7: "int64"}


@dataclass(frozen=True)
class VisionOnnx:
    """An exported vision graph."""

    path: Path  # the .onnx file; its weights are beside it
    dtype: Dtype
    edition: TrtEdition
    opset: int
    spec: GraphSpec
    seconds: float


def export_inputs(ckpt: Checkpoint, dtype: Dtype, edition: TrtEdition, hash_file) \
        -> dict[str, Any]:
    """What an export depends on (JSON): a previous export with equal inputs can be reused.
    `hash_file(path) -> sha256`."""
    files = sorted({info.file for name, info in ckpt.tensors.items()
                    if name.startswith(VISION_PREFIX)})
    pixels = PixelConfig.of_checkpoint(ckpt)
    return {"dtype": dtype.value, "opset": OPSETS[edition], "exporter": f"qvl-trt {__version__}",
            "spec": to_jsonable(vision_graph_spec(ckpt.vision, dtype)),
            # The graph normalises the 8-bit pixels with the processor's table.
            "pixel_lut": fingerprint(pixels.lut.tolist()),
            # The uint8 pixels' one cast: an export made before that rule is not reused.
            "pixel_cast": UINT8_INPUT_CAST.value,
            "vision_config": ckpt.config.get("vision_config", {}),
            "weights": {f: hash_file(ckpt.path / f) for f in files}}


def export_vision_onnx(ckpt: Checkpoint, out: Path, *, dtype: Dtype | str = Dtype.FLOAT16,
                       edition: TrtEdition = TrtEdition.TENSORRT_RTX,
                       inputs: dict[str, Any] | None = None) -> VisionOnnx:
    """Export the checkpoint's vision tower in `dtype`, for a TensorRT `edition`, into the
    folder `out` (created; must not exist or be empty). `inputs` (see `export_inputs`) is
    recorded in onnx.json."""
    torch = require("torch", extra="export", why="export the vision tower to ONNX")
    require("onnxscript", extra="export", why="export the vision tower to ONNX")
    from .tower import example_inputs, load_vision_tower

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BuildError(f"{out} exists and is not an empty folder; pick another --out or "
                         "delete it")
    spec = vision_graph_spec(ckpt.vision, dtype)  # refuses a dtype the graph is not made in
    dtype = Dtype(dtype)
    opset = OPSETS[edition]
    started = time.perf_counter()
    tower = load_vision_tower(ckpt, dtype)
    # Patch counts are whole merge blocks; at least 2 blocks, since torch.export
    # specialises a size-1 axis (the merged-token axis of a single block).
    blocks = torch.export.Dim(MERGE_BLOCKS, min=MIN_BLOCKS)
    patches = ckpt.vision.spatial_merge_size ** 2 * blocks
    log.info("exporting the vision tower (%s, opset %d) to ONNX", dtype, opset)
    with _quiet_exporter():
        exported = torch.export.export(
            tower, example_inputs(ckpt, EXAMPLE_GRID),
            dynamic_shapes=tuple({i: patches for i, d in enumerate(t.shape) if d == PATCHES}
                                 for t in spec.inputs), strict=False)
        program = torch.onnx.export(
            exported, dynamo=True, input_names=list(spec.input_names),
            output_names=list(spec.output_names), opset_version=opset, optimize=True,
            verbose=False)
    del exported, tower
    _name_output_axes(program, spec)

    with staged_dir(out) as staging:
        program.save(staging / ONNX_NAME, external_data=True)
        del program
        check_onnx_io(staging / ONNX_NAME, spec)
        seconds = time.perf_counter() - started
        write_json_atomic(staging / ONNX_META_NAME, {
            "dtype": dtype.value, "edition": edition.value, "opset": opset,
            "spec": to_jsonable(spec),
            "example_grid": list(EXAMPLE_GRID), "inputs": inputs or {}})  # no times: hashed
    log.info("exported %s in %.1f s", out / ONNX_NAME, seconds)
    return VisionOnnx(out / ONNX_NAME, dtype, edition, opset, spec, seconds)


def read_export_meta(folder: Path) -> dict[str, Any] | None:
    """onnx.json of an export folder, or None when there is no complete export there."""
    meta = Path(folder) / ONNX_META_NAME
    if not (meta.is_file() and (Path(folder) / ONNX_NAME).is_file()):
        return None
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError:
        return None


def check_onnx_io(path: Path, spec: GraphSpec) -> None:
    """Raise BuildError unless the graph's inputs/outputs have the spec's names, dtypes and
    ranks (static dims must match; dynamic ones must be symbolic) and each uint8 input feeds
    one cast to float32, all full TensorRT takes (spec.check_uint8_input)."""
    onnx = require("onnx", extra="export", why="read the ONNX graph")
    graph = onnx.load(str(path), load_external_data=False).graph
    for kind, values, specs in (("input", graph.input, spec.inputs),
                                ("output", graph.output, spec.outputs)):
        got = [(v.name, _ONNX_DTYPES.get(v.type.tensor_type.elem_type, "?"),
                tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or "?"
                      for d in v.type.tensor_type.shape.dim)) for v in values]
        want = [(t.name, t.dtype, t.shape) for t in specs]
        if got != want:
            raise BuildError(f"{path}: graph {kind}s {got} differ from the vision spec {want}; "
                             "the export is broken: report it with `qvl-trt doctor` output")
    for value in graph.input:
        if value.type.tensor_type.elem_type == onnx.TensorProto.UINT8:
            check_uint8_input(str(path), value.name, _uses(graph, value.name))


def _uses(graph, name: str) -> list[tuple[str, str | None]]:
    """Each use of the value `name` in `graph` and its subgraphs, as check_uint8_input takes
    them."""
    uses: list[tuple[str, str | None]] = [("graph output", None)
                                          for o in graph.output if o.name == name]
    for node in _nodes(graph):
        to = None
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            cast = next(a.i for a in node.attribute if a.name == "to")
            to = _ONNX_DTYPES.get(cast, f"ONNX type {cast}")
        uses += [(node.op_type, to)] * list(node.input).count(name)
    return uses


def _nodes(graph) -> Iterator[Any]:
    """The graph's nodes and those of the subgraphs in their attributes (If, Loop, Scan)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _nodes(sub)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx prints progress, warns about torchvision being absent and raises
    FutureWarnings from its own internals: route all of it to our debug log."""
    chatter = io.StringIO()
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(chatter):
            warnings.simplefilter("always")
            yield
    finally:
        registration.setLevel(level)
    for w in caught:
        log.debug("torch.onnx warning: %s", w.message)
    if chatter.getvalue().strip():
        log.debug("torch.onnx: %s", chatter.getvalue().strip())


def _name_output_axes(program, spec: GraphSpec) -> None:
    """The exporter names axes after their expressions (4*num_blocks, num_blocks); give
    them the spec's names."""
    ir = require("onnx_ir", extra="export", why="export the vision tower to ONNX")
    graph = program.model.graph
    values = list(graph.inputs) + list(graph.outputs)
    for value, tensor in zip(values, spec.inputs + spec.outputs, strict=True):
        value.shape = ir.Shape(list(tensor.shape))
