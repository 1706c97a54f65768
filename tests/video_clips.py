"""Small real video files and frame lists for the video tests, made at test time: MP4
(H.264) and WebM (VP9) written by PyAV, frames as PNG. Each frame is a smooth gradient that
moves with time plus a little noise, so consecutive frames differ and codecs keep them apart."""

from __future__ import annotations

import base64
import io
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image


def frame_pixels(index: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8: frame `index` of clip `seed`."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    shift = 7.0 * index + 31.0 * seed
    rgb = np.stack([(x * 255 / max(width - 1, 1) + shift) % 256,
                    (y * 255 / max(height - 1, 1) + 2 * shift) % 256,
                    ((x + y) * 128 / max(width + height, 1) + 3 * shift) % 256], axis=-1)
    noise = np.random.default_rng(seed * 1000 + index).integers(0, 24, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def png_frames(count: int, width: int, height: int, seed: int = 0) -> tuple[bytes, ...]:
    frames = []
    for i in range(count):
        buffer = io.BytesIO()
        Image.fromarray(frame_pixels(i, width, height, seed)).save(buffer, "PNG")
        frames.append(buffer.getvalue())
    return tuple(frames)


def video_file(count: int, width: int, height: int, *, rate: int = 10, seed: int = 0,
               container: str = "mp4", faststart: bool = False, quick: bool = False) -> bytes:
    """A video file of `count` frames at `rate` frames per second: MP4 (H.264; `faststart`:
    its index first, as web servers want it) or WebM (VP9). `quick` (H.264 only): x264's
    fastest preset at low quality, for large clips whose sizes matter and not their detail
    (30 frames of 1280x720 encode in a quarter of a second rather than 4.5, into 0.3 MB rather
    than 7.7)."""
    codec = {"mp4": "libx264", "webm": "libvpx-vp9"}[container]
    coding = {"preset": "ultrafast", "crf": "35"} if quick else {}
    if faststart:  # FFmpeg moves the index by reading the finished file again, by name
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"clip.{container}"
            _encode(path, codec, count, width, height, rate, seed, container,
                    {"movflags": "faststart"}, coding)
            return path.read_bytes()
    buffer = io.BytesIO()
    _encode(buffer, codec, count, width, height, rate, seed, container, {}, coding)
    return buffer.getvalue()


def _encode(target, codec: str, count: int, width: int, height: int, rate: int, seed: int,
            container: str, options: dict[str, str], coding: dict[str, str]) -> None:
    import av

    with av.open(target, mode="w", format=container, options=options) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = coding
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height, seed),
                                               format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def data_uri(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()
