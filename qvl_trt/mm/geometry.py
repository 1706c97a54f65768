"""Image and video geometry: the resize policies and the token counts they imply."""

from __future__ import annotations

import math

from ..checkpoint import RESIZE_FACTOR, TEMPORAL_PATCH_SIZE
from ..errors import InputError

MAX_ASPECT_RATIO = 200
# The vision graph takes at least 2 merge blocks (torch.export specialises size-1 axes): an
# image is never that small (its minimum is the profile's), a video's frames can be.
MIN_BLOCKS = 2


def smart_resize(
    height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int = RESIZE_FACTOR
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the pixel count inside
    [min_pixels, max_pixels], aspect ratio kept as closely as possible (the Qwen2/3-VL
    policy, including Python's round-half-even)."""
    if height <= 0 or width <= 0:
        raise InputError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(
            f"image of {width}x{height} has an aspect ratio above {MAX_ASPECT_RATIO}:1; "
            "crop or pad it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_token_count(height: int, width: int, *, min_pixels: int, max_pixels: int) -> int:
    """Merged visual tokens an image of this size becomes."""
    h, w = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // RESIZE_FACTOR) * (w // RESIZE_FACTOR)


def video_smart_resize(
    frames: int, height: int, width: int, *, min_pixels: int, max_pixels: int,
    factor: int = RESIZE_FACTOR, temporal_factor: int = TEMPORAL_PATCH_SIZE,
) -> tuple[int, int]:
    """(height, width) of every frame of a video: the budget [min_pixels, max_pixels] bounds
    frames x height x width, so a longer clip gets smaller frames (transformers'
    video_processing_qwen3_vl.smart_resize, its upscale of frames below `factor` included)."""
    if frames < temporal_factor:
        raise InputError(f"video has {frames} frame{'s' * (frames != 1)}; a video needs at "
                         f"least {temporal_factor}: send a single frame as an image")
    if height <= 0 or width <= 0:
        raise InputError(f"video frames have no pixels ({width}x{height})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(
            f"video frames of {width}x{height} have an aspect ratio above "
            f"{MAX_ASPECT_RATIO}:1; crop or pad them"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_pixel_budget(frames: int, *, max_pixels: int, max_pixels_per_frame: int,
                       temporal_factor: int = TEMPORAL_PATCH_SIZE) -> int:
    """The most pixels (frames x height x width) a video of `frames` frames may keep: the
    checkpoint's (or deployment's) whole-video budget, and no frame above
    `max_pixels_per_frame` (the vision engine takes one temporal group per call). While the
    frame cap does not bind this is transformers' uncapped default, so pixels match it.
    video_smart_resize compares the budget with t_bar, the frame count rounded half-even to
    temporal groups, which can be below `frames` (5 -> 4): the cap is scaled by the smaller,
    or a frame could exceed it."""
    t_bar = round(frames / temporal_factor) * temporal_factor
    return min(max_pixels, max_pixels_per_frame * min(frames, t_bar))


def video_token_count(frames: int, height: int, width: int, *, min_pixels: int,
                      max_pixels: int, max_pixels_per_frame: int) -> int:
    """Merged visual tokens a video of `frames` sampled frames becomes: one grid per two
    frames (an odd count repeats the last frame)."""
    budget = video_pixel_budget(frames, max_pixels=max_pixels,
                                max_pixels_per_frame=max_pixels_per_frame)
    h, w = video_smart_resize(frames, height, width, min_pixels=min_pixels, max_pixels=budget)
    groups = -(-frames // TEMPORAL_PATCH_SIZE)
    return groups * (h // RESIZE_FACTOR) * (w // RESIZE_FACTOR)
