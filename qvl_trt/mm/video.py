"""Video intake after decoding: frame sampling, the video resize rule and pixel budget, temporal
pairing and the timestamps of the prompt, equal to transformers' Qwen3-VL video processor
(models/qwen3_vl/video_processing_qwen3_vl.py) and processor (processing_qwen3_vl.py).

- Sampling (`sample_indices`, HF `Qwen3VLVideoProcessor.sample_frames`): int(frames / native
  fps * fps) frames, clamped to [min_frames, max_frames] and to the frames there are, evenly
  spread by `np.linspace(...).round()`.
- Resize (mm/geometry.py `video_smart_resize`, HF video `smart_resize`): one size for every
  frame, from a pixel budget over the whole clip (`video_pixel_budget`): the reference
  per-frame cap (768 tokens a frame, or an even share of `size.longest_edge` of
  video_preprocessor_config.json; HF `cap_pixels_per_frame=True`), within the deployment's
  caps, so a longer clip gets smaller frames and a short one does not spend the clip's whole
  budget.
- Pairing: consecutive frames (2g, 2g+1) fill the two temporal slots of temporal group g's
  patches; an odd count repeats the last frame (HF `patchify`). Each group is one vision item
  of grid (1, h, w): the tower attends within a group (HF splits `cu_seqlens` per grid_t), so
  it runs group by group like images, and caches by each group's content.
- Timestamps (`group_timestamps`, HF `_calculate_timestamps`): a group's time is the mean of
  its first and last frame's time, written `<t.t seconds>` before its vision tokens.

Frames are resized as the HF video processor resizes them (torchvision's `resize(...,
BICUBIC, antialias=True)` on uint8: PyTorch's native kernel, `taps.torch_taps`, the width pass
first, rounded to uint8 before the height pass), not with PIL as images are: PIL's filter
rounds its weights differently and lands up to 2 levels away (tests/test_mm_video_hf.py
compares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ..checkpoint import PIXELS_PER_VIDEO_TOKEN
from ..errors import CheckpointError, EngineLimitError, InputError
from . import kernels
from .geometry import MIN_BLOCKS, video_pixel_budget, video_smart_resize
from .kernels import pixel_pool
from .pixels import ImagePatches, PixelConfig, channel_plane
from .taps import torch_taps

# transformers' Qwen3VLVideoProcessor class values where video_preprocessor_config.json leaves
# them out (the released checkpoints leave out all three).
HF_DEFAULT_FPS = 2.0
HF_DEFAULT_MIN_FRAMES = 4
HF_DEFAULT_MAX_FRAMES = 768
# size.shortest_edge / longest_edge (pixels of a whole clip) of the released Qwen3-VL
# checkpoints' video_preprocessor_config.json, for clients that count tokens without one.
RELEASED_CLIP_PIXELS = (4096, 25165824)


@dataclass(frozen=True)
class VideoLimits:
    """What a deployment admits per request for videos (RequestLimits.video; the preprocessing
    model's parameters of the same names; a profile's limits.max_videos_per_request,
    .video_max_frames, .video_max_pixels_per_frame, .video_max_tokens)."""

    max_videos: int = 2  # videos per request; 0 turns video input off
    # Frames of one video the model sees: a file is sampled down to at most this many, a frame
    # list above it is refused (also capped by the checkpoint's max_frames).
    max_video_frames: int = 768
    # A video file longer than this is refused before its frames are decoded.
    max_video_seconds: float = 600.0
    # Pixels of one resized frame; 0: the deployment's max pixels per image (which the vision
    # engine's optimisation profile covers).
    max_video_frame_pixels: int = 0
    # Merged tokens of one video: its pixel budget (frames x height x width) is at most this x
    # PIXELS_PER_VIDEO_TOKEN, below the checkpoint's (frames are scaled down to fit); 0: the
    # checkpoint's budget.
    max_video_tokens: int = 0

    def check_video_count(self, count: int) -> None:
        if count > self.max_videos:
            raise EngineLimitError(
                f"request has {count} videos, the deployment allows {self.max_videos} (the "
                "max_videos parameter); send fewer videos"
                + (" or their frames as images" if not self.max_videos else ""))

    def clip_pixels(self, checkpoint_max: int) -> int:
        """One video's pixel budget: the checkpoint's, capped by max_video_tokens."""
        if not self.max_video_tokens:
            return checkpoint_max
        return min(checkpoint_max, self.max_video_tokens * PIXELS_PER_VIDEO_TOKEN)


@dataclass(frozen=True)
class VideoConfig:
    """A checkpoint's video processor settings: patching and the clip's pixel budget
    (`pixels`: min/max are pixel counts of the whole clip) and the frame sampling."""

    pixels: PixelConfig
    fps: float = HF_DEFAULT_FPS
    min_frames: int = HF_DEFAULT_MIN_FRAMES
    max_frames: int = HF_DEFAULT_MAX_FRAMES

    @classmethod
    def from_processor_config(cls, config: dict[str, Any], where: str) -> VideoConfig:
        pixels = PixelConfig.from_preprocessor_config(config, where)
        try:
            fps = float(config.get("fps") or HF_DEFAULT_FPS)
            min_frames = int(config.get("min_frames") or HF_DEFAULT_MIN_FRAMES)
            max_frames = int(config.get("max_frames") or HF_DEFAULT_MAX_FRAMES)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: fps/min_frames/max_frames are not numbers ({exc}); "
                                  "re-download the checkpoint's video_preprocessor_config.json"
                                  ) from None
        if not (math.isfinite(fps) and fps > 0 and 1 <= min_frames <= max_frames):
            raise CheckpointError(f"{where}: fps {fps}, min_frames {min_frames}, max_frames "
                                  f"{max_frames} are not a valid sampling; fix the file")
        return cls(pixels, fps, min_frames, max_frames)

    @classmethod
    def of_checkpoint(cls, checkpoint) -> VideoConfig:
        """video_preprocessor_config.json, or preprocessor_config.json where it is missing
        (transformers' video processor falls back to that file the same way)."""
        config = checkpoint.video_preprocessor_config
        name = "video_preprocessor_config.json" if config else "preprocessor_config.json"
        return cls.from_processor_config(config or checkpoint.preprocessor_config,
                                         f"{checkpoint.path}/{name}")

    def check_matches(self, image: PixelConfig) -> None:
        """The vision graph normalises video pixels with the image processor's table and
        takes the same patches: the two configs must agree on both."""
        mine, theirs = self.pixels, image
        if (mine.patch_size, mine.temporal_patch_size, mine.merge_size, mine.lut.tobytes(),
                mine.resample) != (theirs.patch_size, theirs.temporal_patch_size,
                                   theirs.merge_size, theirs.lut.tobytes(), theirs.resample):
            raise CheckpointError("the video processor's patch sizes, normalisation or resampling "
                                  "differ from the image processor's; the vision engine takes "
                                  "one of each: this is not a Qwen3-VL checkpoint")
        if mine.resample != Image.Resampling.BICUBIC:
            raise CheckpointError(f"the video processor resamples with filter {mine.resample}; "
                                  "qvl-trt resizes video frames bicubically (Qwen3-VL's): set "
                                  "resample to 3 in video_preprocessor_config.json")


def sample_indices(total_frames: int, native_fps: float, fps: float, *, min_frames: int,
                   max_frames: int) -> np.ndarray:
    """Indices of the frames of a decoded file the model sees (HF
    `Qwen3VLVideoProcessor.sample_frames` with `fps`)."""
    count = int(total_frames / native_fps * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def group_timestamps(frame_times: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's (HF
    `_calculate_timestamps`; an odd count repeats the last frame's time)."""
    times = [float(t) for t in frame_times]
    times += [times[-1]] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(times), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    """What precedes a temporal group's vision tokens in the prompt (HF `replace_video_token`)."""
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class VideoPatches:
    """One video as the vision tower takes it: a vision item per temporal group."""

    groups: tuple[ImagePatches, ...]  # grid (1, h, w) each, in time order
    timestamps: tuple[float, ...]  # seconds, one per group
    frame_count: int  # frames before pairing (an odd count repeats its last)

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """HF's video_grid_thw row: (temporal groups, h, w)."""
        _, h, w = self.groups[0].grid_thw
        return len(self.groups), h, w

    @property
    def num_patches(self) -> int:
        return sum(g.num_patches for g in self.groups)


def resized_video_size(frames: Sequence[Image.Image], config: PixelConfig,
                       frame_cap: int) -> tuple[int, int]:
    """(height, width) every frame of the clip is resized to; frames must share one size."""
    width, height = frames[0].size
    for number, frame in enumerate(frames[1:], 2):
        if frame.size != (width, height):
            raise InputError(f"video frame {number} is {frame.width}x{frame.height}, frame 1 "
                             f"is {width}x{height}: all frames of a video must have one size; "
                             "resize them to the same size")
    return clip_frame_size(len(frames), width, height, config, frame_cap)


def clip_frame_size(count: int, width: int, height: int, config: PixelConfig,
                    frame_cap: int) -> tuple[int, int]:
    """(height, width) each of `count` frames of width x height is resized to (known from a
    file's header before its frames decode), refusing a size the vision engine does not
    take."""
    budget = video_pixel_budget(count, min_pixels=config.min_pixels,
                                max_pixels=config.max_pixels, max_pixels_per_frame=frame_cap,
                                frame_token_cap=config.frame_token_cap,
                                temporal_factor=config.temporal_patch_size)
    h, w = video_smart_resize(count, height, width, min_pixels=config.min_pixels,
                              max_pixels=budget, factor=config.factor,
                              temporal_factor=config.temporal_patch_size)
    if h * w > frame_cap:
        raise InputError(f"video frames of {width}x{height} resize to {w}x{h}, above the "
                         f"{frame_cap} pixels a frame may have; send smaller frames")
    if (h // config.factor) * (w // config.factor) < MIN_BLOCKS:
        raise InputError(f"video frames of {width}x{height} resize to {w}x{h}, below the "
                         f"{MIN_BLOCKS} blocks of {config.factor}x{config.factor} pixels the "
                         "vision engine takes; send larger frames or fewer of them")
    return h, w


def video_patch_count(frames: Sequence[Image.Image], config: PixelConfig,
                      frame_cap: int) -> int:
    """Rows `video_patches` makes of these frames (to size a request's buffer first)."""
    return clip_patch_count(len(frames), *resized_video_size(frames, config, frame_cap), config)


def clip_patch_count(count: int, height: int, width: int, config: PixelConfig) -> int:
    """Rows of `count` frames resized to height x width: a group per temporal_patch_size."""
    groups = -(-count // config.temporal_patch_size)
    return groups * (height // config.patch_size) * (width // config.patch_size)


def video_patches(frames: Sequence[Image.Image], frame_times: Sequence[float],
                  config: PixelConfig, frame_cap: int, out: np.ndarray,
                  size: tuple[int, int] | None = None) -> VideoPatches:
    """Resize RGB frames (one size) and cut them into uint8 patch rows written into `out`
    ([video_patch_count, patch_dim], e.g. a slice of the request's buffer), two frames per
    temporal group; `frame_times` are each frame's seconds. `size`: the (height, width) the
    clip resizes to when known already (frames that were resized as they decoded are at it;
    the rule is not applied to them again: it is not idempotent)."""
    if any(f.mode != "RGB" for f in frames) or config.channels != 3:
        raise InputError("video_patches takes RGB frames for a 3-channel processor; decode "
                         "them with load_rgb")
    h, w = size or resized_video_size(frames, config, frame_cap)
    t, p = config.temporal_patch_size, config.patch_size
    per_group = (h // p) * (w // p)
    groups = -(-len(frames) // t)
    if out.shape != (groups * per_group, config.patch_dim) or out.dtype != np.uint8:
        raise ValueError(f"out is {out.dtype} {out.shape}, the video needs uint8 "
                         f"{(groups * per_group, config.patch_dim)}")
    resized = resize_frames(frames, h, w)  # each frame's channel planes
    resized += [resized[-1]] * (groups * t - len(resized))
    patches = []
    for g in range(groups):
        rows = out[g * per_group:(g + 1) * per_group]
        pair = resized[g * t:(g + 1) * t]
        for slot, planes in enumerate(pair):
            for channel, plane in enumerate(planes):
                kernels.write_patches(plane, rows, 0, channel, t, slot, 1, p,
                                      config.merge_size)
        patches.append(ImagePatches(pixel_values=rows, grid_thw=(1, h // p, w // p)))
    return VideoPatches(tuple(patches), tuple(group_timestamps(frame_times, t)), len(frames))



def resize_frames(frames: Sequence[Image.Image], height: int, width: int) \
        -> list[list[np.ndarray]]:
    """Each RGB frame -> its channel planes resized to [height, width] uint8, frames in
    parallel threads (the kernels release the GIL)."""
    return list(pixel_pool().map(lambda frame: resize_frame(frame, height, width), frames))


def resize_frame(frame: Image.Image, height: int, width: int) -> list[np.ndarray]:
    """One RGB frame -> its channel planes resized to [height, width] uint8: the width pass
    first, rounded to uint8, then the height pass, as PyTorch's kernel does."""
    resize = kernels.Resize(torch_taps(frame.height, height) if frame.height != height else None,
                            torch_taps(frame.width, width) if frame.width != width else None)
    # A plane at a time: the frames resize side by side, an 8K frame's planes are 100 MB.
    return [resize.rows(channel_plane(frame, band), 0, height) for band in frame.getbands()]
