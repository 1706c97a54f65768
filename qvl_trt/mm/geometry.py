"""Image geometry: the resize policy and the token counts it implies."""

from __future__ import annotations

import math

from ..checkpoint import RESIZE_FACTOR
from ..errors import InputError

MAX_ASPECT_RATIO = 200


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
