"""Image and video geometry: the resize policies and the token counts they imply."""

from __future__ import annotations

import math

from ..checkpoint import PIXELS_PER_IMAGE_TOKEN, RESIZE_FACTOR, TEMPORAL_PATCH_SIZE
from ..errors import InputError

MAX_ASPECT_RATIO = 200
# The vision graph takes at least 2 merge blocks (torch.export specialises size-1 axes): an
# image is never that small (its minimum is the profile's), a video's frames can be.
MIN_BLOCKS = 2
# The reference per-frame cap of a video: a frame has at most this many merged tokens' pixels
# (this many tokens a temporal pair), else an even share of the clip's budget, and not below
# 1.05 x the clip's minimum (`video_pixel_budget`). qwen-vl-utils vision_process.py
# VIDEO_MAX_TOKEN_NUM; transformers' Qwen3VLVideoProcessor.max_video_tokens, applied with
# cap_pixels_per_frame=True.
FRAME_TOKEN_CAP = 768
# OpenAI's `detail: low` as a pixel cap: a 1920x1080 image becomes 384x672, 252 merged tokens
# (docs/openai.md); never above the deployment's maximum nor below its minimum.
LOW_DETAIL_MAX_PIXELS = 512 * 512


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


def video_pixel_budget(frames: int, *, min_pixels: int, max_pixels: int,
                       max_pixels_per_frame: int, frame_token_cap: int = FRAME_TOKEN_CAP,
                       temporal_factor: int = TEMPORAL_PATCH_SIZE) -> int:
    """The most pixels (frames x height x width) a video of `frames` frames may keep.
    - The reference rule (transformers 5.25 video_processing_qwen3_vl.py `resize` with
      cap_pixels_per_frame=True, after qwen-vl-utils `fetch_video`): each frame gets
      min(frame_token_cap tokens' pixels, max_pixels // frames), at least 1.05 x min_pixels,
      so a short clip costs fewer tokens than a long one instead of spending the whole clip
      budget on a few frames.
    - Never above the clip budget `max_pixels` (the checkpoint's, or a deployment's lower one).
    - No frame above `max_pixels_per_frame` (the vision engine takes one temporal group per
      call). video_smart_resize compares the budget with t_bar, the frame count rounded
      half-even to temporal groups, which can be below `frames` (5 -> 4): this cap is scaled
      by the smaller, or a frame could exceed it.
    qwen-vl-utils sizes frames one by one (its image smart_resize, a 128-token minimum, a
    128k-token `total_pixels`); transformers' form over the checkpoint's `size` is followed
    here, and equals it while a frame's share is the binding term."""
    t_bar = round(frames / temporal_factor) * temporal_factor
    share = max(min(frame_token_cap * PIXELS_PER_IMAGE_TOKEN, max_pixels // max(frames, 1)),
                int(min_pixels * 1.05))
    return min(share * frames, max_pixels, max_pixels_per_frame * min(frames, t_bar))


def video_token_count(frames: int, height: int, width: int, *, min_pixels: int,
                      max_pixels: int, max_pixels_per_frame: int) -> int:
    """Merged visual tokens a video of `frames` sampled frames becomes: one grid per two
    frames (an odd count repeats the last frame)."""
    budget = video_pixel_budget(frames, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_pixels_per_frame=max_pixels_per_frame)
    h, w = video_smart_resize(frames, height, width, min_pixels=min_pixels, max_pixels=budget)
    groups = -(-frames // TEMPORAL_PATCH_SIZE)
    return groups * (h // RESIZE_FACTOR) * (w // RESIZE_FACTOR)
