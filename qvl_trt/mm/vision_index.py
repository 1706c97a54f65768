"""Host index tensors of the export-friendly vision tower, from an image's patch grid.

Hugging Face computes these inside the vision forward from `grid_thw` with data-dependent
loops, which freezes an exported graph at the traced size. The host computes them instead
(numpy only: the Triton preprocessing model calls this), so the engine sees plain tensors of a
dynamic patch count. Rows follow HF's patch order: each 4 consecutive rows are one 2x2 merge
block, blocks in raster order.

The vision graph's input names live here, below both their users: mm/ names the tensors it
hands over (request.py), vision/spec.py builds the graph's specs from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..checkpoint import VisionDims
from ..errors import InputError

# The vision graph's inputs, in the tower's argument order: an item's uint8 patch rows, then
# the index tensors below.
PIXEL_VALUES = "pixel_values"
POS_INTERP_INDICES = "pos_interp_indices"
POS_INTERP_WEIGHTS = "pos_interp_weights"
ROPE_POSITION_IDS = "rope_position_ids"


@dataclass(frozen=True)
class VisionIndex:
    """Index inputs of one vision engine call (one image, N patches)."""

    pos_interp_indices: np.ndarray  # [N, 4] int32 rows of the learned position table
    pos_interp_weights: np.ndarray  # [N, 4] float32 bilinear weights of those rows
    rope_position_ids: np.ndarray  # [N, 2] int32 (patch row, patch column) for the 2D rotary

    @property
    def num_patches(self) -> int:
        return int(self.rope_position_ids.shape[0])

    def as_dict(self) -> dict[str, np.ndarray]:
        """By the vision graph's input names, in its order."""
        return {POS_INTERP_INDICES: self.pos_interp_indices,
                POS_INTERP_WEIGHTS: self.pos_interp_weights,
                ROPE_POSITION_IDS: self.rope_position_ids}


def vision_index_tensors(grid_thw: Sequence[int] | np.ndarray, vision: VisionDims) \
        -> VisionIndex:
    """The index tensors for one image whose patch grid is `grid_thw` = (1, h, w).

    A video is encoded frame by frame (HF attends within a frame only): call this with
    (1, h, w) per frame.
    """
    t, h, w = _grid(grid_thw)
    merge = vision.spatial_merge_size
    if t != 1:
        raise InputError(f"grid_thw {(t, h, w)} has t={t}; the vision engine takes one image or "
                         f"one video frame per call: pass (1, {h}, {w}) for each frame")
    if h <= 0 or w <= 0 or h % merge or w % merge:
        raise InputError(f"grid_thw {(t, h, w)}: height and width must be positive multiples "
                         f"of the spatial merge size {merge}; resize with smart_resize first")
    side = int(round(vision.num_position_embeddings ** 0.5))
    if side * side != vision.num_position_embeddings:
        raise InputError(f"num_position_embeddings {vision.num_position_embeddings} is not a "
                         "square table; this is not a Qwen3-VL vision config")

    # Patch n sits in merge block (n // m^2) at offset (n % m^2); blocks in raster order.
    n = np.arange(h * w, dtype=np.int64)
    block, inner = n // (merge * merge), n % (merge * merge)
    row = (block // (w // merge)) * merge + inner // merge
    col = (block % (w // merge)) * merge + inner % merge

    h_taps, h_weights = _axis_taps(row, h, side)
    w_taps, w_weights = _axis_taps(col, w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return VisionIndex(
        pos_interp_indices=indices.astype(np.int32),
        pos_interp_weights=weights.astype(np.float32),
        rope_position_ids=np.stack([row, col], axis=1).astype(np.int32),
    )


def _grid(grid_thw: Sequence[int] | np.ndarray) -> tuple[int, int, int]:
    arr = np.asarray(grid_thw)
    if arr.shape == (1, 3):
        arr = arr[0]
    if arr.shape != (3,) or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"grid_thw must be three integers (t, h, w), got {grid_thw!r}")
    t, h, w = (int(v) for v in arr)
    return t, h, w


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two taps into a `side`-long table and their weights for positions 0..size-1 of an axis:
    bilinear with align_corners, computed in float32 the way transformers does, so the
    weights match its own to the last bit."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor[:, None].astype(np.int64) + offsets.astype(np.int64), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    weights = np.maximum(np.float32(1) - distance, np.float32(0))
    return taps, weights
