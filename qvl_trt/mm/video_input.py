"""A request's video's intake (chat_messages.VideoInput: a file, or a list of frames with their
rate or times) -> the RGB frames the model sees and each frame's seconds.

Conventions (qwen-vl-utils, vLLM): a file's `fps` is the rate it is sampled at (default the
checkpoint's, 2); a frame list's `fps` is the rate its frames were taken at (default 2, as
qwen-vl-utils' `sample_fps`), or `timestamps` give each frame's seconds. A frame list is used
as sent (no sampling), as transformers does with `do_sample_frames=False`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from PIL import Image

from ..chat_messages import VideoFile, VideoFrames, VideoInput, check_fps
from ..errors import EngineLimitError, InputError
from .image_input import load_rgb
from .video import VideoConfig, VideoLimits
from .video_decode import Sampling, decode_video

DEFAULT_FRAME_LIST_FPS = 2.0  # qwen-vl-utils' sample_fps default


def load_clip(video: VideoInput, config: VideoConfig, limits: VideoLimits, *,
              max_decoded_pixels: int,
              before_decoding: Callable[[int, int, int], tuple[int, int] | None] | None
              = None) \
        -> tuple[tuple[Image.Image, ...], tuple[float, ...]]:
    """The frames the model sees (RGB) and their seconds; a file's header is shown to
    `before_decoding` (video_decode.decode_video) before its frames decode."""
    max_frames = min(config.max_frames, limits.max_video_frames)
    if isinstance(video, VideoFile):
        fps = config.fps if video.fps is None else check_fps(video.fps, "fps")
        clip = decode_video(bytes(video.data), Sampling(
            fps=fps, min_frames=config.min_frames, max_frames=max_frames,
            max_seconds=limits.max_video_seconds, max_decoded_pixels=max_decoded_pixels),
            before_decoding)
        return clip.frames, clip.times
    if not isinstance(video, VideoFrames):
        raise InputError(f"got a {type(video).__name__} where a video was expected; send a "
                         "video file or a list of frames")
    count = len(video.frames)
    if count > max_frames:
        raise EngineLimitError(f"video has {count} frames, above the limit of {max_frames} "
                               "(the max_video_frames parameter, or the checkpoint's "
                               "max_frames); sample fewer frames")
    if count < 2:
        raise InputError(f"video has {count} frame{'s' * (count != 1)}; a video needs at least "
                         "2: send a single frame as an image")
    times = _frame_times(video, count)
    frames = []
    for number, frame in enumerate(video.frames, 1):
        try:
            frames.append(load_rgb(frame, max_decoded_pixels=max_decoded_pixels))
        except InputError as exc:
            raise InputError(f"video frame {number}: {exc}") from None
    return tuple(frames), times


def _frame_times(video: VideoFrames, count: int) -> tuple[float, ...]:
    if video.timestamps is None:
        fps = DEFAULT_FRAME_LIST_FPS if video.fps is None else check_fps(video.fps, "fps")
        return tuple(i / fps for i in range(count))
    if video.fps is not None:
        raise InputError("a video's frames come with fps or with timestamps, not both; send one")
    times = _numbers(video.timestamps)
    if len(times) != count:
        raise InputError(f"video has {count} frames but {len(times)} timestamps; send one "
                         "timestamp (seconds) per frame")
    if not all(math.isfinite(t) and t >= 0 for t in times) or \
            any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise InputError("video timestamps must be finite seconds >= 0 in increasing order; "
                         "send each frame's time")
    return times


def _numbers(values: Sequence[object]) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in values)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError("video timestamps must be numbers (seconds); send a list of "
                         "numbers") from None
