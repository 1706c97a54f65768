"""Bicubic antialiased resize of uint8 RGB frames, equal to the last bit to what transformers'
Qwen3-VL video processor computes: torchvision's `resize(..., BICUBIC, antialias=True)` on a
uint8 CPU tensor, which runs PyTorch's native uint8 kernel (aten/src/ATen/native/cpu/
UpSampleKernel.cpp `_compute_index_ranges_int16_weights` and UpSampleKernelAVXAntialias.h).

That kernel is Pillow's separable filter (Keys cubic, a = -0.5, support scaled when
shrinking) with its weights rounded to int16 at a precision chosen from the largest weight,
the width pass first, its output rounded to uint8 before the height pass. Pillow keeps 22
fractional bits, so its results differ by up to 2 levels; this module computes PyTorch's
taps and runs them through the compiled passes images use (kernels.py), one channel plane at
a time (tests/test_mm_video_hf.py compares with torchvision where it imports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from PIL import Image

from . import kernels
from .pixels import channel_planes
from .threads import pixel_pool

_A = -0.5  # Keys' cubic: PyTorch's (and Pillow's) choice with antialiasing


def resize_frames(frames: Sequence[Image.Image], height: int, width: int) \
        -> list[list[np.ndarray]]:
    """Each RGB frame -> its channel planes resized to [height, width] uint8, frames in
    parallel threads (the kernels release the GIL)."""
    return list(pixel_pool().map(lambda frame: resize_frame(frame, height, width), frames))


def resize_frame(frame: Image.Image, height: int, width: int) -> list[np.ndarray]:
    """One RGB frame -> its channel planes resized to [height, width] uint8: the width pass
    first, rounded to uint8, then the height pass, as the kernel does."""
    resize = kernels.Resize(_taps(frame.height, height) if frame.height != height else None,
                            _taps(frame.width, width) if frame.width != width else None)
    return [resize.rows(plane, 0, height) for plane in channel_planes(frame)]


@lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int) -> kernels.Taps:
    """PyTorch's taps for one side: int16 weights (held as int32) at the precision it picks
    (`_compute_indices_min_size_weights_aa` with double weights)."""
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
    bounds = np.stack([first, count], axis=1).astype(np.int32)
    return kernels.Taps(bounds, rounded[:, :used].astype(np.int32), precision)
