"""The resize taps the compiled passes (kernels.py) run: for each output position of one
side, the first input index, how many inputs it weighs, and integer weights at a fixed-point
precision. Two separable filters compute them, each equal to the last bit to its source:

- Pillow's (src/libImaging/Resample.c precompute_coeffs, then normalize_coeffs_8bpc: 22
  fractional bits), which the Hugging Face image processor's PIL backend resizes with
  (`pillow_taps`, images);
- PyTorch's native uint8 antialiased kernel (aten/src/ATen/native/cpu/UpSampleKernel.cpp
  `_compute_index_ranges_int16_weights`, UpSampleKernelAVXAntialias.h: int16 weights at a
  precision chosen from the largest weight), which transformers' video processor reaches
  through torchvision's `resize(..., BICUBIC, antialias=True)` (`torch_taps`, video frames).

Both place and normalise the filter the same way (`_normalised`); each evaluates its own
filter polynomial in its own order of operations, since float results must match the source
to the bit, and quantises as its source does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
from PIL import Image

from .kernels import Taps

Weight = Callable[[np.ndarray], np.ndarray]  # distance -> filter weight


# Pillow's filters the kernels reproduce (Resample.c; bicubic with a = -0.5).
def _pillow_bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _pillow_bilinear(x: np.ndarray) -> np.ndarray:
    return np.where(x < 1.0, 1.0 - x, 0.0)


# resample -> (support, weight), for the filters the kernels run; others go to Pillow.
PILLOW_FILTERS = {int(Image.Resampling.BICUBIC): (2.0, _pillow_bicubic),
                  int(Image.Resampling.BILINEAR): (1.0, _pillow_bilinear)}
_PILLOW_PRECISION = 22  # Resample.c PRECISION_BITS (32 - 8 - 2): the 8-bit passes' bits


def _torch_bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5  # Keys' cubic: PyTorch's choice with antialiasing
    return np.where(x < 1.0, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


def _normalised(in_size: int, out_size: int, support: float, weight: Weight
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first input, inputs weighed, float64 weights summing to 1) per output position: the
    filter's support scaled when shrinking, centred on the output's centre, weights added up
    in tap order as both C loops do."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support *= filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's (int): truncation
    count = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - first,
                    0, ksize)
    taps = np.arange(ksize)
    x = np.abs((taps[None, :] + first[:, None] - center[:, None] + 0.5) * (1.0 / filterscale))
    k = np.where(taps[None, :] < count[:, None], weight(x), 0.0)
    total = np.zeros(out_size)
    for t in range(ksize):
        total += k[:, t]
    k = np.divide(k, total[:, None], out=k, where=total[:, None] != 0.0)
    return first, count, k


def _fixed_point(k: np.ndarray, precision: int) -> np.ndarray:
    """Round half away from zero, as both sources do."""
    scaled = k * (1 << precision)
    return np.where(k < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)


def _bounds(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    return np.stack([first, count], axis=1).astype(np.int32)


@lru_cache(maxsize=128)
def pillow_taps(in_size: int, out_size: int, resample: int) -> Taps:
    """Pillow's taps for one side, `resample` one of PILLOW_FILTERS."""
    support, weight = PILLOW_FILTERS[resample]
    first, count, k = _normalised(in_size, out_size, support, weight)
    return Taps(_bounds(first, count), _fixed_point(k, _PILLOW_PRECISION), _PILLOW_PRECISION)


@lru_cache(maxsize=64)
def torch_taps(in_size: int, out_size: int) -> Taps:
    """PyTorch's bicubic antialiased taps for one side: int16 weights (held as int32) at the
    most fractional bits (up to 22) that keep the largest weight below 2^15
    (`_compute_indices_min_size_weights_aa` with double weights)."""
    first, count, k = _normalised(in_size, out_size, 2.0, _torch_bicubic)
    largest = k.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    used = int(count.max())  # taps past every position's count weigh 0: skip them
    return Taps(_bounds(first, count), _fixed_point(k[:, :used], precision), precision)
