"""The vision graph's input/output contract: names, dtypes and named dynamic axes. One spec
drives the ONNX export (its dynamic shapes and axis names), the check of the exported graph,
the TensorRT optimisation profile and the engine's recorded I/O. The Triton vision_encoder
model's dims are not these (it takes pixels and grids and computes the index inputs itself):
they are in triton/contract.py. Light (no torch, no TensorRT)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..checkpoint import VisionDims
from ..dtypes import Dtype, pick
from ..errors import BuildError
from ..mm.geometry import MIN_BLOCKS, smart_resize
from ..mm.vision_index import (
    PIXEL_VALUES,
    POS_INTERP_INDICES,
    POS_INTERP_WEIGHTS,
    ROPE_POSITION_IDS,
)
from ..profiles import BuildLimits

# Precisions the vision graph can be exported in: the engine's (dtypes.py
# VISION_ENGINE_DTYPES) and float32, the reference graph the export is validated with.
VISION_DTYPES = (Dtype.FLOAT16, Dtype.BFLOAT16, Dtype.FLOAT32)

# The pixels' dtype at every step: the resized image's 8-bit values (qvl_trt/mm/pixels.py).
PIXEL_DTYPE = "uint8"
# Full TensorRT takes a uint8 network input only into a cast to float: "kUINT8 conversions are
# only supported for {kFLOAT, kHALF}", "not supported for {kINT8, kINT32, kBOOL}" (the
# DataType::kUINT8 comment, include/NvInferRuntimeBase.h); "All UINT8 inputs must directly feed
# into a cast layer", not even a reshape (NVIDIA/TensorRT issue #3985). TensorRT-RTX 1.7 builds
# a uint8 -> int32 cast too, so its build proves nothing: the graph's uint8 input feeds one
# cast to this, and both the export check and the engine build refuse anything else.
UINT8_INPUT_CAST = Dtype.FLOAT32

# Named dynamic axes.
PATCHES = "num_patches"
TOKENS = "num_tokens"  # merged tokens: num_patches / spatial_merge_size^2
MERGE_BLOCKS = "num_blocks"  # = num_tokens; the export's free variable

# The image size the optimisation profile is tuned for (the planner's typical request).
OPT_IMAGE = (1080, 1920)  # height, width


@dataclass(frozen=True)
class GraphTensor:
    name: str
    dtype: str  # a Dtype's value, "int32" or "uint8"
    shape: tuple[int | str, ...]  # a str is a named dynamic axis

    @property
    def dims(self) -> tuple[int, ...]:
        """Shape with -1 for dynamic axes (ONNX / TensorRT / Triton convention)."""
        return tuple(-1 if isinstance(d, str) else d for d in self.shape)

    def concrete(self, axes: dict[str, int]) -> tuple[int, ...]:
        return tuple(axes[d] if isinstance(d, str) else d for d in self.shape)


@dataclass(frozen=True)
class GraphSpec:
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def tensor(self, name: str) -> GraphTensor:
        return next(t for t in self.inputs + self.outputs if t.name == name)


def check_uint8_input(where: str, name: str, uses: Sequence[tuple[str, str | None]]) -> None:
    """Raise BuildError unless the uint8 input `name` has one use, a cast to
    UINT8_INPUT_CAST. `uses`: per use, (operation, the dtype name a cast makes or None)."""
    if list(uses) == [("Cast", UINT8_INPUT_CAST.value)]:
        return
    found = ", ".join(op if to is None else f"{op} to {to}" for op, to in uses) or "nothing"
    raise BuildError(f"{where}: uint8 input {name!r} feeds {found}; full TensorRT takes a uint8 "
                     f"input only into one Cast to {UINT8_INPUT_CAST} (NvInferRuntimeBase.h, "
                     "DataType::kUINT8): re-export the vision graph with this qvl-trt version")


@dataclass(frozen=True)
class PatchRange:
    """Patch counts of the TensorRT optimisation profile (each a multiple of the merge
    block)."""

    min: int
    opt: int
    max: int

    def input_shapes(self, spec: GraphSpec) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Input name -> (min, opt, max) shapes."""
        return {t.name: tuple(t.concrete({PATCHES: n}) for n in (self.min, self.opt, self.max))
                for t in spec.inputs}


def vision_graph_spec(vision: VisionDims, dtype: Dtype | str) -> GraphSpec:
    """The vision graph of a checkpoint in precision `dtype`: inputs are what the host
    computes (uint8 pixels, which the graph normalises; float32 / int32 indices); outputs are
    in the graph's precision."""
    dtype = pick(dtype, VISION_DTYPES, "vision dtype")
    inputs = (
        GraphTensor(PIXEL_VALUES, PIXEL_DTYPE, (PATCHES, vision.patch_dim)),
        GraphTensor(POS_INTERP_INDICES, "int32", (PATCHES, 4)),
        GraphTensor(POS_INTERP_WEIGHTS, Dtype.FLOAT32.value, (PATCHES, 4)),
        GraphTensor(ROPE_POSITION_IDS, "int32", (PATCHES, 2)),
    )
    names = ["image_embeds"] + [f"deepstack_{k}" for k in range(vision.deepstack_count)]
    outputs = tuple(GraphTensor(n, dtype.value, (TOKENS, vision.out_hidden_size)) for n in names)
    return GraphSpec(inputs, outputs)


def patch_range(vision: VisionDims, limits: BuildLimits) -> PatchRange:
    """Patch counts an image, or a video's pair of frames, admitted by the profile's pixel
    limits can have. A video's frames have no floor of their own (the video budget bounds
    frames x pixels, so a long small clip keeps small frames): with video on, the engine
    takes down to the graph's MIN_BLOCKS."""
    block_pixels = (vision.patch_size * vision.spatial_merge_size) ** 2
    block = vision.spatial_merge_size ** 2
    hi_blocks = limits.vision_max_pixels // block_pixels
    lo_pixels = 0 if limits.max_videos_per_request else limits.vision_min_pixels
    lo_blocks = min(max(MIN_BLOCKS, -(-lo_pixels // block_pixels)), hi_blocks)
    h, w = smart_resize(*OPT_IMAGE, min_pixels=limits.vision_min_pixels,
                        max_pixels=limits.vision_max_pixels,
                        factor=vision.patch_size * vision.spatial_merge_size)
    opt = (h // vision.patch_size) * (w // vision.patch_size)
    return PatchRange(lo_blocks * block, min(max(opt, lo_blocks * block), hi_blocks * block),
                      hi_blocks * block)
