"""RGB image -> the vision tower's 8-bit `pixel_values` rows and `grid_thw`, equal to the
Hugging Face Qwen2-VL/Qwen3-VL image processor (PIL backend) to the last bit.

HF resizes the uint8 image with PIL, then rescales in float64, casts to float32 and normalises
in float32; every output value is therefore a function of one uint8 and its channel, so a
256-entry table per channel (`PixelConfig.lut`) reproduces it exactly. The host sends the
uint8 values and the vision graph looks them up in that table itself (vision/tower.py), so
an image crosses the host as 1 byte per value instead of 4.

Rows are patches ordered so that each merge^2 consecutive rows form one merge block (blocks
in raster order); within a row the order is (channel, temporal frame, y, x). An image fills
every temporal frame with itself; a video clip will put its consecutive frames there, so the
vision graph takes both through one input of the same shape.

The resize and the patch cutting run in strips of output rows on the pixel pool, one channel
plane at a time, in compiled loops (kernels.py) that compute Pillow's integer arithmetic
(Resample.c: its taps and 22-bit weights, taps.py): 6x Pillow's speed for the
vertical pass, 1.4x for the horizontal one, on one thread. Pillow resizes in at most two
passes, each rounding to 8 bits, in an order of its choosing when both sides change (Pillow 13
starts with the vertical pass when the height shrinks by more than twice as many pixels as the
width, Pillow 12 and older always with the horizontal one): `_pass_order` probes which rule
the installed Pillow follows, and a filter without taps here or an unknown rule leaves that
resize to Pillow in one call. The content digest is xxh3-128 of the patch rows and their
grid, a fast non-cryptographic hash: it keys caches, it does not authenticate.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash
from PIL import Image

from ..errors import CheckpointError, InputError
from . import kernels
from .geometry import FRAME_TOKEN_CAP, smart_resize
from .kernels import pixel_pool
from .taps import PILLOW_FILTERS, pillow_taps

# The HF processor's values where a preprocessor_config.json leaves them out.
_HF_DEFAULT_RESCALE = 1 / 255


@dataclass(frozen=True)
class PixelConfig:
    """The image processor settings of a checkpoint, with the deployment's pixel bounds."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = _HF_DEFAULT_RESCALE
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    # Videos: merged tokens one frame may cost under the reference cap (the video processor
    # config's max_video_tokens); images do not read it.
    frame_token_cap: int = FRAME_TOKEN_CAP
    # uint8 value -> output value, one 256-entry row per channel, flattened.
    lut: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.image_mean) != len(self.image_std):
            raise CheckpointError(f"image_mean {list(self.image_mean)} and image_std "
                                  f"{list(self.image_std)} differ in length")
        if not 0 <= self.min_pixels <= self.max_pixels:
            raise CheckpointError(f"pixel bounds [{self.min_pixels}, {self.max_pixels}] are "
                                  "empty; min_pixels must not exceed max_pixels")
        values = np.arange(256, dtype=np.float64)
        if self.do_rescale:
            values = values * self.rescale_factor
        rows = np.broadcast_to(values.astype(np.float32), (self.channels, 256))
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None]
            rows = (rows - mean) / std
        object.__setattr__(self, "lut", np.ascontiguousarray(rows, dtype=np.float32).ravel())

    @property
    def channels(self) -> int:
        return len(self.image_mean)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge block of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size**2

    @property
    def lut_offsets(self) -> np.ndarray:
        """[patch_dim] int32: where each row column's channel table starts in `lut` (a row is
        (channel, temporal frame, y, x))."""
        per_channel = self.patch_dim // self.channels
        return (np.arange(self.patch_dim, dtype=np.int32) // per_channel) * 256

    def normalise(self, pixel_values: np.ndarray) -> np.ndarray:
        """uint8 rows [N, patch_dim] -> the float32 rows the Hugging Face processor makes (what
        the vision graph computes from them)."""
        return self.lut[pixel_values.astype(np.int32) + self.lut_offsets]

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any], where: str) -> PixelConfig:
        """Read a checkpoint's preprocessor_config.json (`size` holds min/max PIXEL counts as
        shortest_edge/longest_edge; older files use min_pixels/max_pixels)."""
        size = dict(config.get("size") or {})
        try:
            min_pixels = int(config.get("min_pixels") or size["shortest_edge"])
            max_pixels = int(config.get("max_pixels") or size["longest_edge"])
            return cls(
                min_pixels=min_pixels, max_pixels=max_pixels,
                patch_size=int(config["patch_size"]),
                temporal_patch_size=int(config["temporal_patch_size"]),
                merge_size=int(config["merge_size"]),
                image_mean=tuple(float(v) for v in config["image_mean"]),
                image_std=tuple(float(v) for v in config["image_std"]),
                rescale_factor=float(config.get("rescale_factor", _HF_DEFAULT_RESCALE)),
                do_rescale=bool(config.get("do_rescale", True)),
                do_normalize=bool(config.get("do_normalize", True)),
                resample=int(config.get("resample", Image.Resampling.BICUBIC)),
                frame_token_cap=int(config.get("max_video_tokens") or FRAME_TOKEN_CAP),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where} lacks or mangles an image processor field ({exc!r}); "
                                  "re-download the checkpoint's preprocessor_config.json") from None

    @classmethod
    def of_checkpoint(cls, checkpoint) -> PixelConfig:
        """A `Checkpoint`'s image processor settings, with its own pixel bounds."""
        return cls.from_preprocessor_config(checkpoint.preprocessor_config,
                                            f"{checkpoint.path}/preprocessor_config.json")

    def with_bounds(self, min_pixels: int, max_pixels: int) -> PixelConfig:
        """The same processor with other pixel bounds (a deployment's cap)."""
        return replace(self, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class ImagePatches:
    """One vision item as the tower takes it: an image, or a video's temporal group."""

    pixel_values: np.ndarray  # [h*w, patch_dim] uint8, merge-block row order
    grid_thw: tuple[int, int, int]  # patches along (time, height, width)
    # 16-byte xxh3-128 of the rows and the grid: the item's content key (vision cache, KV
    # reuse), taken from exactly what the tower reads, so equal keys mean equal tower inputs
    # whether the rows were cut from an image or from a video's pair of frames.
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        digest = xxhash.xxh3_128(self.pixel_values)
        digest.update(np.array(self.grid_thw, np.uint32).tobytes())
        object.__setattr__(self, "digest", digest.digest())

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]

    @property
    def hash64(self) -> int:
        """The digest's first 8 bytes: the image's id in prompt_table_extra_ids."""
        return int.from_bytes(self.digest[:8], "little")


def resized_size(width: int, height: int, config: PixelConfig) -> tuple[int, int]:
    """(height, width) the image is resized to, refusing one below a single merge block."""
    h, w = smart_resize(height, width, min_pixels=config.min_pixels,
                        max_pixels=config.max_pixels, factor=config.factor)
    if h < config.factor or w < config.factor:
        raise InputError(
            f"image of {width}x{height} resizes to {w}x{h}, smaller than one {config.factor}x"
            f"{config.factor} merge block (min_pixels {config.min_pixels}); send a larger image "
            "or raise the minimum pixel count")
    return h, w


def image_patch_count(image: Image.Image, config: PixelConfig) -> int:
    """Rows `image_patches` makes of this image (to size a request's buffer first)."""
    h, w = resized_size(image.width, image.height, config)
    return (h // config.patch_size) * (w // config.patch_size)


def image_patches(image: Image.Image, config: PixelConfig,
                  out: np.ndarray | None = None) -> ImagePatches:
    """Resize an RGB image (`load_rgb`'s output) and cut it into uint8 patch rows, written
    into `out` ([image_patch_count, patch_dim] contiguous uint8, e.g. a slice of the request's
    buffer) when given."""
    if image.mode != "RGB" or config.channels != 3:
        raise InputError(f"image_patches takes RGB images for a 3-channel processor, got mode "
                         f"{image.mode!r} and {config.channels} channels; decode with load_rgb")
    h, w = resized_size(image.width, image.height, config)
    gh, gw = h // config.patch_size, w // config.patch_size
    shape = (gh * gw, config.patch_dim)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype} {out.shape}, the image needs contiguous uint8 "
                         f"{shape}")
    _cut(image, h, w, config, out)
    return ImagePatches(pixel_values=out, grid_thw=(1, gh, gw))


def warm_up(config: PixelConfig) -> None:
    """Compile the kernels for every kind of resize (none, either side, both in either order)
    now, a few seconds, rather than in the first requests that need them."""
    f = config.factor
    for width, height, w, h in ((f, f, f, f), (f, f + 1, f, f), (f + 1, f, f, f),
                                (2 * f, f + 1, f, f), (f + 1, 4 * f, f, f)):
        rows = (h // config.patch_size) * (w // config.patch_size)
        _cut(Image.new("RGB", (width, height)), h, w, config,
             np.empty((rows, config.patch_dim), np.uint8))


def _cut(image: Image.Image, h: int, w: int, config: PixelConfig, out: np.ndarray) -> None:
    """Resize `image` to w x h and write its patch rows into `out`."""
    plan = _pillow_resize(image.width, image.height, w, h, config.resample)
    if plan is None:  # a filter or pass order the kernels do not reproduce: Pillow, one call
        image = image.resize((w, h), resample=config.resample)
        plan = kernels.Resize(None, None)
    planes = channel_planes(image)
    f, frames = config.factor, config.temporal_patch_size  # an image fills every frame slot

    def strip(edges: tuple[int, int]) -> None:
        for channel, plane in enumerate(planes):
            kernels.write_patches(plan.rows(plane, *edges), out, edges[0] // f, channel,
                                  frames, 0, frames, config.patch_size, config.merge_size)

    _in_strips(strip, h, f)


def channel_planes(image: Image.Image) -> list[np.ndarray]:
    """The image's channels as [height, width] uint8 planes (read-only), each straight from
    PIL's raw encoder: what the kernels take."""
    return [channel_plane(image, band) for band in image.getbands()]


def channel_plane(image: Image.Image, band: str) -> np.ndarray:
    """One channel of `channel_planes` (to hold one plane of a large image at a time)."""
    return np.frombuffer(image.tobytes("raw", band), np.uint8).reshape(image.height, -1)


def _pillow_resize(width: int, height: int, w: int, h: int, resample: int) \
        -> kernels.Resize | None:
    """Pillow's resize of one size to another as the kernels run it: each changed side's
    taps (taps.py) and the installed Pillow's pass order. None where the kernels would
    not equal Pillow: a filter without taps here, or both sides changing under a pass order
    none of the known rules matches."""
    if (width, height) == (w, h):
        return kernels.Resize(None, None)
    if resample not in PILLOW_FILTERS:
        return None
    vertical_first = False
    if width != w and height != h:
        rule = _pass_order(resample)
        if rule is None:
            return None
        vertical_first = rule(width, height, w, h)
    return kernels.Resize(pillow_taps(height, h, resample) if height != h else None,
                          pillow_taps(width, w, resample) if width != w else None,
                          vertical_first)


def _vertical_first_pillow13(width: int, height: int, w: int, h: int) -> bool:
    """Pillow 13 starts with the vertical pass when the height shrinks by more than twice as
    many pixels as the width does (python-pillow/Pillow#9549 "If height is scaled down
    significantly more than width, resize vertically first"; the rule as the 13.0.0 wheel
    behaves, tests/test_mm_pixels.py checks it over many sizes)."""
    return h < height and height - h > 2 * (width - w)


def _horizontal_first(width: int, height: int, w: int, h: int) -> bool:
    """Pillow up to 12: always the horizontal pass first (src/libImaging/Resample.c,
    ImagingResampleInner)."""
    return False


_PASS_ORDERS = (_vertical_first_pillow13, _horizontal_first)
# (width, height) a 64x64 probe is resized to: where the known rules pick different orders
_PROBE_SIZES = ((40, 8), (36, 8), (100, 60), (30, 90))


@functools.cache
def _pass_order(resample: int) -> Callable[[int, int, int, int], bool] | None:
    """The installed Pillow's rule for which pass comes first, among the known ones: the one
    whose two separate passes equal one whole resize of a small noise image at every probe
    size (a Pillow with another rule fits none: None)."""
    probe = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))

    def fits(rule: Callable[[int, int, int, int], bool]) -> bool:
        for w, h in _PROBE_SIZES:
            first = (64, h) if rule(64, 64, w, h) else (w, 64)
            two = probe.resize(first, resample=resample).resize((w, h), resample=resample)
            if two.tobytes() != probe.resize((w, h), resample=resample).tobytes():
                return False
        return True

    return next((rule for rule in _PASS_ORDERS if fits(rule)), None)


def _in_strips(work: Callable[[tuple[int, int]], None], length: int, unit: int) -> None:
    """`work` on each of up to `_THREADS` strips [a, b) of `length`, cut at multiples of
    `unit`: the first on this thread, the others on the pixel pool (the kernels release the
    GIL). Returns once all are done."""
    units = length // unit
    edges = sorted({units * k // _THREADS * unit for k in range(_THREADS)} | {length})
    first, *rest = itertools.pairwise(edges)
    pending = [pixel_pool().submit(work, strip) for strip in rest]
    try:
        work(first)
    finally:
        wait(pending)
    for done in pending:
        done.result()


_THREADS = min(os.cpu_count() or 1, 4)  # strips: one per core, at most 4
