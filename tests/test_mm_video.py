"""Video intake on the host (qvl_trt.mm.video, video_input, video_decode, and the video path of
mm.request): sampling, resize and timestamps against transformers' own Qwen3-VL functions,
the prompt and pixel layout, real MP4/WebM files decoded with PyAV, and every bad input
refused in one line that names the fix."""

from __future__ import annotations

import math
import types
from pathlib import Path

import numpy as np
import pytest
from video_clips import frame_pixels, png_frames, video_file

from qvl_trt.chat_messages import VideoFile, VideoFrames, user_message
from qvl_trt.errors import InputError
from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
from qvl_trt.mm.video import VideoLimits, group_timestamps, sample_indices

av = pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")


@pytest.fixture(scope="module")
def pre(tiny_ckpt: Path) -> RequestPreprocessor:
    """The checkpoint's own processors with a small deployment: 96x96 pixels per image or video
    frame at most, two videos of at most 8 frames, 30 s."""
    limits = RequestLimits(max_images=2, max_input_len=2048, max_seq_len=4096,
                           min_pixels=1024, max_pixels=96 * 96,
                           video=VideoLimits(max_videos=2, max_video_frames=8,
                                             max_video_seconds=30))
    return RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)


def ask_video(pre: RequestPreprocessor, *videos, images=(), prompt="What happens?"):
    return pre.prepare(messages=user_message(prompt, len(images), len(videos)), images=images,
                       videos=videos)


# ---- the rules, against transformers' functions ----------------------------------------------

@pytest.mark.parametrize("total, native, fps", [(95, 30.0, 2.0), (8, 10.0, 2.0), (3, 30.0, 2.0),
                                                (3000, 25.0, 2.0), (301, 29.97, 0.5),
                                                (40, 24.0, 10.0)])
def test_sampling_equals_hf(total: int, native: float, fps: float) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf_self = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    hf = Qwen3VLVideoProcessor.sample_frames(hf_self, VideoMetadata(total_num_frames=total,
                                                                    fps=native), fps=fps)
    ours = sample_indices(total, native, fps, min_frames=4, max_frames=768)
    assert ours.tolist() == hf.tolist()


def test_timestamps_equal_hf() -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices in ([0, 3, 6, 9, 12], [0, 1], list(range(0, 90, 7))):
        hf = Qwen3VLProcessor._calculate_timestamps(None, list(indices), 29.97, 2)
        assert group_timestamps([i / 29.97 for i in indices], 2) == hf


# ---- the prompt and the pixels ------------------------------------------------------------

def test_frames_become_timed_groups_in_the_prompt(pre: RequestPreprocessor) -> None:
    frames = png_frames(5, 96, 64)
    request = ask_video(pre, VideoFrames(frames, fps=4.0))
    (clip,) = request.videos
    assert clip.frame_count == 5 and clip.timestamps == (0.125, 0.625, 1.0)
    assert clip.grid_thw == (3, 4, 6)  # 64x96 keeps its size: 4x6 patches per frame
    tokenizer = pre.prompts.tokenizer
    text = tokenizer.decode(request.input_ids)
    group = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    # The template's own vision_start/vision_end around the video are gone (the released
    # processor's layout): the text runs straight into the first timestamp.
    assert ("<|im_start|>user\n<0.1 seconds>" + group + "<0.6 seconds>" + group +
            "<1.0 seconds>" + group + "What happens?") in text
    # One vision item per group, each grid (1, h, w), in prompt order; the fake ids count all
    # visual tokens, the extra ids carry each group's hash.
    assert [item.grid_thw for item in request.images] == [(1, 4, 6)] * 3
    assert request.image_token_counts == (6, 6, 6)
    visual = request.engine_input_ids >= pre.checkpoint.text.vocab_size
    assert visual.sum() == 18 and np.all(request.input_ids[visual] == 151656)
    extra = request.prompt_table_extra_ids[visual].reshape(3, 6)
    assert [int(row[0]) for row in extra] == [item.hash64 for item in request.images]
    assert len(set(extra[:, 0].tolist())) == 3
    # Group g holds frame 2g in temporal slot 0 and frame 2g+1 in slot 1; 5 frames: the
    # last group repeats frame 4.
    rows = request.pixel_values.reshape(3, 24, 3, 2, 16 * 16)
    first = frame_pixels(0, 96, 64)[:16, :16]  # patch 0 of frame 0: top-left 16x16
    assert np.array_equal(rows[0, 0, :, 0].reshape(3, 16, 16), first.transpose(2, 0, 1))
    assert np.array_equal(rows[2, :, :, 0], rows[2, :, :, 1])
    assert not np.array_equal(rows[0, :, :, 0], rows[0, :, :, 1])


def test_images_and_videos_keep_their_prompt_order(pre: RequestPreprocessor) -> None:
    image = png_frames(1, 64, 64, seed=5)[0]
    messages = [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"},
        {"type": "video"}]}]
    request = pre.prepare(messages=messages, images=[image],
                          videos=[VideoFrames(png_frames(2, 64, 32)),
                                  VideoFrames(png_frames(4, 32, 64, seed=1))])
    assert [item.grid_thw for item in request.images] == [
        (1, 2, 4), (1, 4, 4), (1, 4, 2), (1, 4, 2)]
    # the rows follow the items: the image's rows sit after the first video's
    image_rows = request.images[1].pixel_values
    assert np.shares_memory(image_rows, request.pixel_values)
    assert image_rows.__array_interface__["data"][0] - \
        request.pixel_values.__array_interface__["data"][0] == 8 * request.pixel_values.shape[1]


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_a_video_file_is_sampled_at_the_requested_rate(pre: RequestPreprocessor,
                                                       container: str) -> None:
    """30 frames at 10 fps (3 s): 2 fps gives 6 frames, 1 fps the minimum of 4. WebM records
    no frame count: it is counted from the packets."""
    data = video_file(30, 64, 48, rate=10, container=container)
    clip = ask_video(pre, VideoFile(data)).videos[0]
    assert clip.frame_count == 6
    assert clip.timestamps == tuple(group_timestamps([i / 10 for i in (0, 6, 12, 17, 23, 29)],
                                                     2))
    assert ask_video(pre, VideoFile(data, fps=1.0)).videos[0].frame_count == 4
    # The deployment's max_video_frames caps the sampling of a long file.
    assert ask_video(pre, VideoFile(data, fps=10.0)).videos[0].frame_count == 8


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_frames_resized_as_they_decode_equal_the_whole_frames_resized(pre, container) -> None:
    """A file's frames are resized as they decode (at most two held at full size); the rows
    equal those of the whole decoded frames resized together, and of the same frames sent
    as a frame list (no resize at decoding there). 160x120 resizes to 96x64 here."""
    from qvl_trt.mm.video_decode import Sampling, decode_video

    data = video_file(30, 160, 120, rate=10, container=container)
    request = ask_video(pre, VideoFile(data))
    config, limits = pre.videos, pre.limits
    whole = decode_video(data, Sampling(
        fps=config.fps, min_frames=config.min_frames,
        max_frames=min(config.max_frames, limits.video.max_video_frames),
        max_seconds=limits.video.max_video_seconds, max_decoded_pixels=limits.max_decoded_pixels))
    assert whole.frames[0].size == (160, 120) and len(whole.frames) == 6
    listed = ask_video(pre, VideoFrames(whole.frames, timestamps=whole.times))
    assert request.videos[0].grid_thw == listed.videos[0].grid_thw == (3, 4, 6)
    assert np.array_equal(request.pixel_values, listed.pixel_values)


def test_same_frames_give_the_same_items_and_keys(pre: RequestPreprocessor) -> None:
    frames = png_frames(4, 64, 64, seed=3)
    one = ask_video(pre, VideoFrames(frames))
    two = ask_video(pre, VideoFrames(frames), prompt="Again?")
    assert [i.digest for i in one.images] == [i.digest for i in two.images]
    other = ask_video(pre, VideoFrames(frames[:2] + frames[3:] + frames[2:3]))
    assert other.images[0].digest == one.images[0].digest  # same first pair
    assert other.images[1].digest != one.images[1].digest  # swapped second pair


# ---- bad input: one line naming the problem and the fix ---------------------------------

def _truncated_webm() -> bytes:
    data = video_file(30, 64, 48, container="webm")
    return data[: len(data) // 2]


BAD_VIDEOS = {
    "corrupt file": (lambda: VideoFile(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50),
                     "could not be read"),
    "truncated mp4": (lambda: VideoFile(video_file(12, 64, 48)[:-400]),
                      "truncated or corrupt"),
    "truncated mp4, index first": (lambda: VideoFile(video_file(30, 64, 48, faststart=True)[:-900]),
                                   "truncated or corrupt"),
    "truncated webm": (lambda: VideoFile(_truncated_webm()), "truncated or corrupt"),
    "unsupported codec": (lambda: VideoFile(video_file(8, 64, 48).replace(b"avc1", b"qvlx")),
                          "the video's codec is not supported"),
    "empty file": (lambda: VideoFile(b""), "video is empty"),
    "one-frame file": (lambda: VideoFile(video_file(1, 64, 48)), "video has 1 frame;"),
    "zero frames": (lambda: VideoFrames(()), "video has 0 frames;"),
    "one frame": (lambda: VideoFrames(png_frames(1, 64, 64)),
                  "a video needs at least 2: send a single frame as an image"),
    "too many frames": (lambda: VideoFrames(png_frames(9, 32, 32)),
                        "video has 9 frames, above the limit of 8"),
    "too long": (lambda: VideoFile(video_file(320, 32, 32, rate=10)),
                 "video is 32.0 s long, above the limit of 30 s"),
    "different sizes": (lambda: VideoFrames(png_frames(2, 64, 64) + png_frames(1, 64, 48)),
                        "video frame 3 is 64x48, frame 1 is 64x64"),
    "fps 0": (lambda: VideoFrames(png_frames(2, 64, 64), fps=0.0), "fps = 0.0 must be"),
    "fps NaN": (lambda: VideoFile(video_file(8, 64, 48), fps=math.nan), "fps = nan must be"),
    "fps and timestamps": (lambda: VideoFrames(png_frames(2, 64, 64), fps=2.0,
                                               timestamps=(0.0, 0.5)), "not both"),
    "timestamps backwards": (lambda: VideoFrames(png_frames(2, 64, 64), timestamps=(1.0, 0.5)),
                             "increasing order"),
    "corrupt frame": (lambda: VideoFrames((png_frames(1, 64, 64)[0], b"not a png")),
                      "video frame 2: image data"),
}


@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_bad_video_is_refused_in_one_line(pre: RequestPreprocessor, case: str) -> None:
    make, message = BAD_VIDEOS[case]
    with pytest.raises(InputError) as refused:
        ask_video(pre, make())
    text = str(refused.value)
    assert message in text and text.startswith("video 1: ")
    assert "\n" not in text and ";" in text  # the problem; the fix


@pytest.mark.parametrize("messages, videos, message", [
    ([{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": [{"type": "video"}]}], 1,
     "message 2: videos go in user messages, not assistant"),
    (user_message("Hi", 0, 3), 3, "request has 3 videos, the deployment allows 2"),
    (user_message("Hi", 0, 1), 0, "messages hold 1 video parts but 0 videos were sent"),
    (user_message("Hi <|video_pad|>", 0, 0), 0, "holds 1 video placeholders for 0 videos"),
])
def test_bad_video_requests_are_refused(pre: RequestPreprocessor, messages, videos: int,
                                        message: str) -> None:
    clip = VideoFrames(png_frames(2, 32, 32))
    with pytest.raises(InputError, match=message):
        pre.prepare(messages=messages, videos=[clip] * videos)


def test_a_video_above_the_deployments_token_budget_is_scaled_down(tiny_ckpt: Path) -> None:
    """max_video_tokens caps one video's pixel budget (tokens x 2048 pixels), so its frames
    shrink to fit, as the checkpoint's own budget shrinks long clips."""
    frames = VideoFrames(png_frames(6, 128, 128))
    uncapped = RequestPreprocessor.from_checkpoint(tiny_ckpt)
    assert sum(ask_video(uncapped, frames).image_token_counts) == 3 * 16
    limits = RequestLimits(max_images=1, max_input_len=2048, max_seq_len=4096,
                           video=VideoLimits(max_video_tokens=12))
    capped = RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)
    request = ask_video(capped, frames)
    assert request.videos[0].grid_thw == (3, 4, 4) and sum(request.image_token_counts) == 12
    off = RequestLimits(max_images=1, max_input_len=2048, max_seq_len=4096,
                        video=VideoLimits(max_videos=0))
    with pytest.raises(InputError, match="allows 0 .* fewer videos or their frames as images"):
        ask_video(RequestPreprocessor.from_checkpoint(tiny_ckpt, off), frames)


def test_frames_below_the_vision_engines_two_blocks_are_refused(tiny_ckpt: Path) -> None:
    # A budget of 4 tokens leaves 6 frames of 32x32: one merge block each, below what the
    # vision graph (and so the engine's optimisation profile) takes.
    limits = RequestLimits(max_images=1, max_input_len=2048, max_seq_len=4096,
                           video=VideoLimits(max_video_tokens=4))
    capped = RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)
    with pytest.raises(InputError, match="resize to 32x32, below the 2 blocks of 32x32 pixels "
                                         "the vision engine takes"):
        ask_video(capped, VideoFrames(png_frames(6, 128, 128)))


def test_a_video_file_is_refused_from_its_header_before_its_frames_decode(tiny_ckpt: Path,
                                                                         pre) -> None:
    """An MP4 with its index first and its frame data cut off: the header alone (8 frames of
    96x96, 4 sampled: 2 groups of 9 tokens) puts it over a cap of 17 visual tokens, so it is
    refused before any frame decodes (decoding would fail on the missing data)."""
    from dataclasses import replace

    data = video_file(8, 96, 96, rate=4, faststart=True)
    cut = data[:data.index(b"mdat") + 64]
    assert sum(ask_video(pre, VideoFile(data)).image_token_counts) == 18
    with pytest.raises(InputError, match="video 1: .*could not be decoded|ended before"):
        ask_video(pre, VideoFile(cut))
    capped = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(pre.limits,
                                                                    max_visual_tokens=17))
    with pytest.raises(InputError, match=r"^video 1: request has 18 visual tokens in 0 images "
                                         r"and 1 videos, the engine's prompt table holds 17"):
        ask_video(capped, VideoFile(cut))


def test_a_missing_pyav_is_one_line_naming_the_extra(pre, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(Exception, match=r"pip install 'qvl-trt\[serve\]'"):
        ask_video(pre, VideoFile(b"\x00" * 64))


@pytest.mark.parametrize("size, to", [((96, 64), (64, 32)), ((64, 48), (64, 64)),
                                      ((333, 517), (320, 512)), ((30, 20), (96, 64))])
def test_frame_resize_is_pillows_filter_with_torchs_rounding(size, to) -> None:
    """The same Keys cubic filter as PIL (so within 2 levels of it: both round to uint8 between
    the passes, with weights rounded at different precisions); the exact comparison with
    torchvision is the torchvision tier's (test_mm_video_hf.py)."""
    from PIL import Image

    from qvl_trt.mm.video import resize_frame

    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    frame = Image.fromarray(pixels)
    ours = np.stack(resize_frame(frame, to[1], to[0]), axis=-1).astype(int)
    pil = np.asarray(frame.resize(to, Image.Resampling.BICUBIC)).astype(int)
    assert ours.shape == pil.shape and np.abs(ours - pil).max() <= 2
    assert np.mean(ours == pil) > 0.9
    assert np.array_equal(np.stack(resize_frame(frame, size[1], size[0]), axis=-1), pixels)
