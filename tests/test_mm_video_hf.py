"""Our host video tensors against transformers' own Qwen3-VL processor (its video processor
needs torchvision, which does not import beside this project's CPU torch: the test runs where
torchvision does, e.g. the GPU machine; `pytest -m torchvision -s` prints the comparison).

Clips of 4, 9 and 30 frames at 640x360 and 1280x720, sent as PNG frames at 2 fps: the input
ids with their timestamps and the grid must be identical, pixel values within one 8-bit level
(the bound this test sets; with torchvision 0.29.1 on a CPU they are equal to the last bit:
mm/taps.py torch_taps is torchvision's uint8 kernel. PIL's bicubic filter, which images use, missed
the bound by one level at the 30-frame 1280x720 clip)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from video_clips import frame_pixels, png_frames

from qvl_trt.deps import available
from qvl_trt.mm.chat import user_message
from qvl_trt.mm.request import RequestPreprocessor
from qvl_trt.mm.video_input import VideoFrames

pytestmark = [
    pytest.mark.torchvision,
    pytest.mark.skipif(not available("torchvision"), reason=(
        "needs torchvision (transformers' Qwen3-VL video processor), which does not import "
        "beside the CPU torch here: run `pytest -m torchvision tests/test_mm_video_hf.py` "
        "where torch and torchvision match, e.g. the GPU machine")),
]

FPS = 2.0
CLIPS = [(frames, width, height) for width, height in ((640, 360), (1280, 720))
         for frames in (4, 9, 30)]


@pytest.fixture(scope="module")
def hf_processor(tiny_ckpt: Path):
    """transformers' Qwen3VLProcessor of the tiny checkpoint (the released checkpoints' image
    and video processor configs and chat template)."""
    import transformers

    return transformers.AutoProcessor.from_pretrained(str(tiny_ckpt))


@pytest.mark.parametrize("frames, width, height", CLIPS,
                         ids=[f"{f}x{w}x{h}" for f, w, h in CLIPS])
def test_host_video_tensors_equal_the_hf_processor(tiny_ckpt: Path, hf_processor, frames: int,
                                                   width: int, height: int) -> None:
    pre = RequestPreprocessor.from_checkpoint(tiny_ckpt)
    messages = user_message("What happens in the video?", 0, 1)
    ours = pre.prepare(messages=messages,
                       videos=[VideoFrames(png_frames(frames, width, height), fps=FPS)])
    text = hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    clip = np.stack([frame_pixels(i, width, height) for i in range(frames)])
    hf = hf_processor(text=[text], videos=[clip], do_sample_frames=False, return_tensors="np",
                      video_metadata=[{"fps": FPS, "total_num_frames": frames,
                                       "frames_indices": list(range(frames))}])

    (video,) = ours.videos
    assert hf["video_grid_thw"].tolist() == [list(video.grid_thw)]
    assert hf["input_ids"][0].tolist() == ours.input_ids.tolist()
    rows = np.concatenate([g.pixel_values for g in video.groups])
    levels = (hf["pixel_values_videos"].astype(np.float64) + 1) * 127.5  # x / 127.5 - 1
    difference = np.abs(levels - rows)
    print(f"\n{frames} frames {width}x{height}: grid {video.grid_thw}, "
          f"{ours.num_tokens} prompt ids equal; pixels: max {difference.max():.3f} levels, "
          f"{np.mean(difference > 0.5):.2%} differ by one level")
    assert difference.max() <= 1 + 1e-3, "pixel values differ by more than one 8-bit level"
