"""Video files (MP4, WebM, MKV, MOV, ...) -> the sampled RGB frames and their times, with PyAV
(the `av` package of the `serve` extra: FFmpeg's demuxers and decoders).

As transformers' `read_video_pyav` (video_utils.py): the native rate is the stream's
average_rate, a frame's time is its index / that rate, frames are converted to RGB24 by
FFmpeg. Where the container does not record a frame count (WebM), it is counted from the
packets first. Decoding stops after the last sampled frame.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from PIL import Image

from ..deps import require
from ..errors import EngineLimitError, InputError
from .kernels import pixel_pool
from .video import resize_frame, sample_indices

_TRUNCATED = "the file is truncated or corrupt, send it again"


@dataclass(frozen=True)
class DecodedClip:
    frames: tuple[Image.Image, ...]  # RGB, the sampled frames in time order
    times: tuple[float, ...]  # seconds of each frame


@dataclass(frozen=True)
class VideoHeader:
    """What a file says of its first video stream, before decoding."""

    frames: int
    fps: float  # native frame rate
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


@dataclass(frozen=True)
class Sampling:
    """How a file's frames are sampled and what a file may be."""

    fps: float  # frames per second the model sees
    min_frames: int
    max_frames: int
    max_seconds: float
    max_decoded_pixels: int  # of one frame, before resizing


def decode_video(data: bytes, sampling: Sampling,
                 before_decoding: Callable[[int, int, int], tuple[int, int] | None] | None
                 = None) -> DecodedClip:
    """Decode the frames of `data` (a whole video file) that `sampling` picks.
    `before_decoding(frames sampled, width, height)`, from the header, may refuse the clip
    before any frame decodes, and returns the (height, width) each frame is resized to as
    soon as it decodes (video.resize_frame, on the pixel pool), or None to keep them whole:
    a clip of large frames then holds one or two of them at full size, not all."""
    av = require("av", extra="serve", why="decode video files")
    with _open(av, data) as container:
        stream = _video_stream(container)
        header = _header(av, container, stream, data)
        total, native_fps = header.frames, header.fps
        pixels = header.width * header.height
        if pixels > sampling.max_decoded_pixels:
            raise InputError(f"video frames of {header.width}x{header.height} = {pixels} "
                             f"pixels exceed the limit of {sampling.max_decoded_pixels} decoded "
                             "pixels; downscale the video before sending")
        if header.seconds > sampling.max_seconds:
            raise EngineLimitError(
                f"video is {header.seconds:.1f} s long, above the limit of "
                f"{sampling.max_seconds:g} s (the preprocessing model's max_video_seconds "
                "parameter); cut it shorter")
        if total < 2:
            raise InputError(f"video has {total} frame{'s' * (total != 1)}; a video needs at "
                             "least 2: send a single frame as an image")
        indices = sample_indices(total, native_fps, sampling.fps,
                                 min_frames=sampling.min_frames, max_frames=sampling.max_frames)
        size = None if before_decoding is None else \
            before_decoding(len(indices), header.width, header.height)
        wanted = set(indices.tolist())
        decoded: dict[int, Image.Image | Future[Image.Image]] = {}
        resizing: deque[Future[Image.Image]] = deque()
        try:
            for number, frame in enumerate(container.decode(stream)):
                if number in wanted:
                    if size is None:
                        decoded[number] = frame.to_image()
                    else:
                        if len(resizing) >= _RESIZING_AT_ONCE:
                            resizing.popleft().result()
                        resizing.append(pixel_pool().submit(_resized, frame.to_image(), size))
                        decoded[number] = resizing[-1]
                if number >= indices[-1]:
                    break
        except av.error.FFmpegError as exc:
            raise InputError(f"video frame {len(decoded) + 1} could not be decoded ({exc}); "
                             f"{_TRUNCATED}") from None
        finally:
            wait(resizing)
    decoded = {i: f.result() if isinstance(f, Future) else f for i, f in decoded.items()}
    if len(decoded) < len(wanted):
        raise InputError(f"the video ended before frame {max(wanted) + 1} of the {total} its "
                         f"header declares; {_TRUNCATED}")
    return DecodedClip(tuple(decoded[i] for i in indices.tolist()),
                       tuple(i / native_fps for i in indices.tolist()))


_RESIZING_AT_ONCE = 2  # full-size frames handed to the pixel pool and not yet resized


def _resized(frame: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`frame` resized as video_patches resizes it (so there it is left as it is)."""
    return Image.merge("RGB", [Image.fromarray(plane) for plane in resize_frame(frame, *size)])


def probe_video(data: bytes) -> VideoHeader:
    """The header of a video file (frame count, rate, size), without decoding frames."""
    av = require("av", extra="serve", why="read video files")
    with _open(av, data) as container:
        return _header(av, container, _video_stream(container), data)


def _header(av, container, stream, data: bytes) -> VideoHeader:
    fps = float(stream.average_rate or stream.guessed_rate or 0)
    if fps <= 0:
        raise InputError("the video file records no frame rate; re-encode it (e.g. ffmpeg -i in "
                         "-r 30 out.mp4) or send its frames with an fps")
    frames = stream.frames or _count_frames(av, data, fps, container.duration)
    return VideoHeader(frames, fps, stream.codec_context.width, stream.codec_context.height)


def _open(av, data: bytes):
    if not data:
        raise InputError("video is empty (0 bytes); send the whole file")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as exc:
        raise InputError(f"video data ({len(data)} bytes) could not be read ({exc.strerror}); it "
                         f"is not a video file FFmpeg reads (MP4, WebM, MKV, MOV, AVI ...) or "
                         f"{_TRUNCATED}") from None


def _video_stream(container):
    streams = container.streams.video
    if not streams:
        raise InputError("the file holds no video stream; send a video file")
    stream = streams[0]
    if stream.codec_context is None:
        raise InputError("the video's codec is not supported (this FFmpeg has no decoder for "
                         "it); re-encode the video as H.264, VP9 or AV1")
    return stream


def _count_frames(av, data: bytes, native_fps: float, duration_us: int | None) -> int:
    """Frames of the first video stream, from its packets (no decoding), checked against the
    container's duration where it records one (a truncated WebM keeps its header's)."""
    with _open(av, data) as container:
        stream = container.streams.video[0]
        try:
            count = sum(1 for packet in container.demux(stream) if packet.size)
        except av.error.FFmpegError as exc:
            raise InputError(f"video could not be read ({exc.strerror}); {_TRUNCATED}") from None
    if duration_us and count < duration_us / 1e6 * native_fps - 1.5:
        raise InputError(f"the video holds {count} frames, its header declares "
                         f"{duration_us / 1e6:.1f} s at {native_fps:g} fps; {_TRUNCATED}")
    return count
