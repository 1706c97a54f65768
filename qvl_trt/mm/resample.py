"""Bicubic antialiased resize of uint8 RGB frames, equal to the last bit to what transformers'
Qwen3-VL video processor computes: torchvision's `resize(..., BICUBIC, antialias=True)` on a
uint8 CPU tensor, which runs PyTorch's native uint8 kernel (aten/src/ATen/native/cpu/
UpSampleKernel.cpp `_compute_index_ranges_int16_weights` and UpSampleKernelAVXAntialias.h).

That kernel is Pillow's separable filter (Keys cubic, a = -0.5, support scaled when
shrinking) with its weights rounded to int16 at a precision chosen from the largest weight,
the width pass first, its output rounded to uint8 before the height pass. Pillow keeps 22
fractional bits, so its results differ by up to 2 levels; this module follows PyTorch's
rounding instead (tests/test_mm_video_hf.py compares with torchvision where it imports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from .threads import pixel_pool

_A = -0.5  # Keys' cubic: PyTorch's (and Pillow's) choice with antialiasing


def resize_frames(frames: Sequence[np.ndarray], height: int, width: int) -> list[np.ndarray]:
    """Each [H, W, C] uint8 frame -> [height, width, C] uint8, frames in parallel threads
    (numpy releases the GIL in the gathers and sums)."""
    return list(pixel_pool().map(lambda frame: resize_frame(frame, height, width), frames))


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8."""
    out = frame
    if out.shape[1] != width:
        out = _resize_axis(out, 1, width)
    if out.shape[0] != height:
        out = _resize_axis(out, 0, height)
    return np.ascontiguousarray(out)


def _resize_axis(image: np.ndarray, axis: int, size: int) -> np.ndarray:
    """One separable pass along `axis`, rounded to uint8 as the kernel does. The resized axis
    goes first and the rest is done in column blocks that stay in cache; numpy casts each
    gathered uint8 block to int32 inside the multiply."""
    index, weights, precision = _taps(image.shape[axis], size)
    rows = np.moveaxis(image, axis, 0)
    source = rows.reshape(rows.shape[0], -1)
    out = np.empty((size, source.shape[1]), np.uint8)
    for start in range(0, source.shape[1], _BLOCK):
        block = source[:, start:start + _BLOCK]
        acc = np.full((size, block.shape[1]), 1 << (precision - 1), np.int32)
        term = np.empty_like(acc)
        for k in range(index.shape[1]):
            np.multiply(block[index[:, k]], weights[:, k, None], out=term, casting="unsafe")
            acc += term
        out[:, start:start + _BLOCK] = np.clip(acc >> precision, 0, 255)
    return np.moveaxis(out.reshape((size,) + rows.shape[1:]), 0, axis)


_BLOCK = 512  # columns per block: ~1 MB of int32 per array at 720-1280 rows


@lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source index and int16 weight of each tap of each output position, and the weights'
    fractional bits (PyTorch `_compute_indices_min_size_weights_aa` with double weights)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)
    count = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - first,
                    0, taps)
    j = np.arange(taps)
    x = np.abs((j[None, :] + first[:, None] - center[:, None] + 0.5) * invscale)
    cubic = np.where(x < 1.0, ((_A + 2) * x - (_A + 3)) * x * x + 1,
                     np.where(x < 2.0, ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A, 0.0))
    weights = np.where(j[None, :] < count[:, None], cubic, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # in order, as the kernel adds them
        total += weights[:, k]
    weights = np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0)
    largest = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    rounded = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
    used = int(count.max())  # taps past every position's count weigh 0: skip them
    index = np.minimum(first[:, None] + j[None, :used], in_size - 1)
    return index, rounded[:, :used].astype(np.int32), precision
