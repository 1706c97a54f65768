"""Image intake: encoded bytes or a PIL image -> an RGB PIL image, or a one-line InputError.

The RGB conversion is Hugging Face's (`convert_to_rgb`: anything with alpha or a transparency
key is composited on white, other modes are converted), so pixels equal what the HF processor
sees; EXIF orientation is applied first, as HF's `load_image` does for files.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InputError

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Declared pixel count above which an image is refused before decoding (8192 x 8192).
DEFAULT_MAX_DECODED_PIXELS = 8192 * 8192
_EXIF_ORIENTATION = 0x0112
_ACCEPTED = "JPEG, PNG, WebP, GIF or BMP"


def read_image_files(paths: Sequence[Path], *, option: str = "--image") -> list[bytes]:
    """The bytes of each `--image` (or `option`) file, refusing a missing one by name."""
    for path in paths:
        if not Path(path).is_file():
            raise InputError(f"{option} {path}: no such file")
    return [Path(path).read_bytes() for path in paths]


def load_rgb(image: bytes | bytearray | memoryview | Image.Image, *,
             max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> Image.Image:
    """Decode `image` (an encoded file's bytes, or a PIL image) to RGB.

    Bytes are identified from their header and refused before decoding when the declared
    size exceeds `max_decoded_pixels`; animated GIF/WebP give their first frame. The decoded
    pixels of bytes are freed once converted (only the RGB image stays).
    """
    if isinstance(image, Image.Image):
        _check_declared_size(image, max_decoded_pixels)
        return _decoded(image)
    opened = open_image(image, max_decoded_pixels=max_decoded_pixels)
    try:
        rgb = _decoded(opened)
    except InputError:
        opened.close()
        raise
    if rgb is not opened:
        opened.close()  # its decoded pixels go now, not when the request's refs do
    return rgb


def open_image(image: bytes | bytearray | memoryview, *,
               max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> Image.Image:
    """The image of these encoded bytes with its header read and its pixels not decoded
    (PIL decodes lazily): its size is known, its cost not yet paid. Refused as load_rgb
    refuses it before decoding."""
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise InputError(f"got a {type(image).__name__} where an image was expected; pass the "
                         f"encoded file's bytes ({_ACCEPTED}) or a PIL image")
    if len(image) == 0:
        raise InputError(f"image is empty (0 bytes); send the whole {_ACCEPTED} file")
    opened = _open(bytes(image))
    _check_declared_size(opened, max_decoded_pixels)
    return opened


def _decoded(opened: Image.Image) -> Image.Image:
    try:
        opened.load()
        return _to_rgb(opened)
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{opened.format or opened.mode} image could not be decoded ({exc}); "
                         "the file is truncated or corrupt, send it again") from None


def _open(data: bytes) -> Image.Image:
    """Read the header only (PIL decodes lazily)."""
    try:
        return Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as exc:
        raise InputError(f"image refused before decoding: {exc}; downscale it") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        pass
    fmt = _identify_any(data)
    if fmt is not None:
        raise InputError(f"image format {fmt} is not accepted; convert it to {_ACCEPTED}")
    raise InputError(f"image data ({len(data)} bytes) is not a readable {_ACCEPTED} file; "
                     "it is corrupt or not an image")


def _identify_any(data: bytes) -> str | None:
    """The format name if some other PIL plugin recognises the data, for a better message."""
    try:
        with Image.open(io.BytesIO(data)) as other:
            return other.format
    except Exception:  # any failure just means "not an image we can name"
        return None


def _check_declared_size(image: Image.Image, limit: int) -> None:
    width, height = image.size
    if width * height > limit:
        raise InputError(f"image of {width}x{height} = {width * height} pixels exceeds the "
                         f"limit of {limit} decoded pixels; downscale it before sending")


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.getexif().get(_EXIF_ORIENTATION, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        return _composited_on_white(image)
    return image if image.mode == "RGB" else image.convert("RGB")


# Rows composited at a time: the whole-image way (HF's) holds four full-size RGBA copies
# (the RGBA conversion, the white background, the composite, then RGB), 1 GB for an
# 8000x8000 image; strips hold one RGB output and a few MB.
_STRIP_ROWS = 256


def _composited_on_white(image: Image.Image) -> Image.Image:
    """HF's `convert_to_rgb` (RGBA conversion, alpha_composite on opaque white, RGB), one
    strip of rows at a time: the same pixels (each is composited on its own)."""
    out = Image.new("RGB", image.size)
    white = Image.new("RGBA", (image.width, _STRIP_ROWS), (255, 255, 255, 255))
    for top in range(0, image.height, _STRIP_ROWS):
        box = (0, top, image.width, min(top + _STRIP_ROWS, image.height))
        rgba = image.crop(box).convert("RGBA")
        background = white if rgba.size == white.size else white.crop((0, 0, *rgba.size))
        out.paste(Image.alpha_composite(background, rgba).convert("RGB"), box[:2])
    return out
