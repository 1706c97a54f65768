"""The pixel path's inner loops, compiled with numba: the two passes of a separable 8-bit
resize and the cutting of resized pixels into patch rows, one channel plane at a time.

A pass computes each output value as Pillow's and PyTorch's uint8 kernels do, in integers:
`clamp((2^(precision-1) + sum(source * weight)) >> precision, 0, 255)` over one output
position's taps, given as `bounds[i] = (first source index, tap count)` and `weights[i]`
(int32, `precision` fractional bits). Which weights and precision make which library's result
is the caller's (taps.py: Pillow's, for images; PyTorch's, for video frames).
Planes are [rows, columns] uint8 of one channel; the functions release the GIL, so strips of
one image, or the frames of a video, run in parallel on the pixel pool.

Every loop runs along contiguous bytes, which the compiler vectorises: the vertical pass adds
whole rows; the horizontal pass, which would gather a few bytes per tap, transposes a band of
rows first so that it becomes the same row-wise sum; a patch row takes `patch` contiguous
bytes of a plane row, copied as 8-byte words where `patch` allows. `Resize` runs the passes
of one size change over a strip of output rows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from . import kernel_cache


class Taps(NamedTuple):
    """One side's taps: bounds [out, 2] int32 (first source index, count) and weights
    [out, ksize] int32 with `precision` fractional bits."""

    bounds: np.ndarray
    weights: np.ndarray
    precision: int

    def rows(self, top: int, bottom: int) -> Taps:
        return Taps(self.bounds[top:bottom], self.weights[top:bottom], self.precision)


@dataclass(frozen=True)
class Resize:
    """A resize of one plane size to another as two 8-bit passes: the changed sides' taps (None:
    that side keeps its size) and which pass comes first where both run."""

    vertical: Taps | None  # per output row
    horizontal: Taps | None  # per output column
    vertical_first: bool = False

    def rows(self, plane: np.ndarray, top: int, bottom: int) -> np.ndarray:
        """Rows [top, bottom) of the resized plane, from the whole source plane: each output
        row needs only its taps' source rows, so strips are independent (the horizontal pass
        of the rows two strips share runs in both)."""
        if self.vertical is None:
            rows = plane[top:bottom]
            return rows if self.horizontal is None else self._across(rows)
        taps = self.vertical.rows(top, bottom)
        across_first = self.horizontal is not None and not self.vertical_first
        if across_first:
            first, last = taps.bounds[0, 0], taps.bounds[-1, 0] + taps.bounds[-1, 1]
            plane = self._across(plane[first:last])
            taps = taps._replace(bounds=taps.bounds - np.array([first, 0], np.int32))
        rows = np.empty((bottom - top, plane.shape[1]), np.uint8)
        vertical_pass(plane, rows, *taps)
        return rows if self.horizontal is None or across_first else self._across(rows)

    def _across(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((rows.shape[0], len(self.horizontal.bounds)), np.uint8)
        horizontal_pass(rows, out, *self.horizontal)
        return out

_BAND = 128  # rows the horizontal pass transposes at a time (fastest of 8-1024 at 1080p)


@numba.njit(nogil=True, inline="always")
def _weighted_sum(acc: np.ndarray, lines: np.ndarray, first: int, count: int,
                  weights: np.ndarray, start: np.int32) -> None:
    """acc = start + the sum over t < count of lines[first + t] * weights[t], in int32."""
    acc[:] = start
    for t in range(count):
        w = weights[t]
        line = lines[first + t]
        for x in range(acc.shape[0]):
            acc[x] += np.int32(line[x]) * w


@numba.njit(nogil=True)
def vertical_pass(src: np.ndarray, dst: np.ndarray, bounds: np.ndarray, weights: np.ndarray,
                  precision: int) -> None:
    """dst[i] from rows bounds[i, 0] ... bounds[i, 0] + bounds[i, 1] - 1 of src."""
    n = src.shape[1]
    acc = np.empty(n, np.int32)
    start = np.int32(1 << (precision - 1))
    for i in range(dst.shape[0]):
        _weighted_sum(acc, src, bounds[i, 0], bounds[i, 1], weights[i], start)
        out = dst[i]
        for x in range(n):
            out[x] = min(max(acc[x] >> precision, 0), 255)


@numba.njit(nogil=True)
def horizontal_pass(src: np.ndarray, dst: np.ndarray, bounds: np.ndarray,
                    weights: np.ndarray, precision: int) -> None:
    """dst[:, j] from columns bounds[j, 0] ... bounds[j, 0] + bounds[j, 1] - 1 of src."""
    width = src.shape[1]
    band = np.empty((width, _BAND), np.uint8)  # band[x] = column x of the band's rows
    acc = np.empty(_BAND, np.int32)
    start = np.int32(1 << (precision - 1))
    for top in range(0, src.shape[0], _BAND):
        rows = min(_BAND, src.shape[0] - top)
        for r in range(rows):
            line = src[top + r]
            for x in range(width):
                band[x, r] = line[x]
        for j in range(dst.shape[1]):
            _weighted_sum(acc, band, bounds[j, 0], bounds[j, 1], weights[j], start)
            for r in range(rows):
                dst[top + r, j] = min(max(acc[r] >> precision, 0), 255)


@numba.njit(nogil=True)
def write_patches(plane: np.ndarray, out: np.ndarray, block_row: int, channel: int,
                  frames: int, first_frame: int, frame_count: int, patch: int,
                  merge: int) -> None:
    """Put one channel's resized pixels (`plane`, whole merge blocks) into the patch rows of
    `out` ([N, channels * frames * patch^2]) from merge-block row `block_row` on, in temporal
    slots first_frame ... first_frame + frame_count - 1 (an image fills every slot, a video
    frame its own): each merge block's merge^2 rows consecutive, blocks in raster order, a
    row's values in (channel, frame, y, x) order."""
    if patch % 8 == 0:  # a patch row is whole 8-byte words: copy those
        _copy_patch_rows(plane.view(np.uint64), out.view(np.uint64), block_row, channel,
                         frames, first_frame, frame_count, patch, merge, patch // 8)
    else:
        _copy_patch_rows(plane, out, block_row, channel, frames, first_frame, frame_count,
                         patch, merge, patch)


@numba.njit(nogil=True)
def _copy_patch_rows(src: np.ndarray, dst: np.ndarray, block_row: int, channel: int,
                     frames: int, first_frame: int, frame_count: int, patch: int, merge: int,
                     words: int) -> None:
    """write_patches in units of `words` items per patch row."""
    blocks_across = src.shape[1] // (words * merge)
    side = patch * merge
    for y in range(src.shape[0]):
        block = (block_row + y // side) * blocks_across
        in_block = (y % side) // patch * merge
        line = src[y]
        for f in range(first_frame, first_frame + frame_count):
            at = ((channel * frames + f) * patch + y % patch) * words
            for bx in range(blocks_across):
                for j in range(merge):
                    row = dst[(block + bx) * merge * merge + in_block + j]
                    x0 = (bx * merge + j) * words
                    for k in range(words):
                        row[at + k] = line[x0 + k]


# The host's thread pool for pixel work (image strips, video frames): numpy, Pillow and the
# passes above release the GIL in their loops, so threads use every core of a preprocessing
# instance.
_POOLS: dict[int, ThreadPoolExecutor] = {}


def pixel_pool() -> ThreadPoolExecutor:
    """One pool per process (a forked child inherits the object, not its threads)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                         thread_name_prefix="qvl-pixels")
    return _POOLS[pid]


# Compiled once per machine, not in every process (kernel_cache.py); keyed by this file's bytes.
kernel_cache.enable(__loader__.get_data(__file__), vertical_pass, horizontal_pass, write_patches,
                    _copy_patch_rows)
