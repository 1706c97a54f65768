"""Our host video tensors against transformers' own Qwen3-VL processor, with the installed
transformers. Its video processor needs torchvision, which does not import beside this
project's CPU torch: it runs in tests/hf_video_processor.py under an interpreter where it does
(qvl_trt/testing/torchvision_env.py: this one on a GPU machine, else a venv made once and kept
in ~/.cache/qvl-trt). `pytest -s` prints the comparison.

Clips of 4, 9 and 30 frames at 640x360 and 4 and 30 at 1280x720, sent as PNG frames at 2 fps,
with the reference's per-frame pixel cap (`cap_pixels_per_frame=True`; 1280x720 frames are
above it): the input ids with their timestamps and the grid must be identical, pixel values
within one 8-bit level (the bound this test sets; with torchvision 0.29.1 on a CPU they are
equal to the last bit: mm/taps.py torch_taps is torchvision's uint8 kernel. PIL's bicubic
filter, which images use, missed the bound by one level at the 30-frame 1280x720 clip)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import transformers
from packaging.version import Version
from video_clips import png_frames

from qvl_trt.chat_messages import VideoFrames, user_message
from qvl_trt.mm.request import RequestPreprocessor
from qvl_trt.testing.container_env import cache_root
from qvl_trt.testing.torchvision_env import CALLER_SITE, torchvision_python

pytestmark = pytest.mark.torchvision

# The transformers releases whose Qwen3-VL processor this parity was shown for. 5.10 to 5.24
# kept the chat template's vision_start/vision_end around a video's timed groups (ids two
# longer than the released model's layout); 5.25 restored 4.57's. A move outside this range
# must show the parity again (this module) before the range moves.
PARITY_TRANSFORMERS = (Version("5.25"), Version("5.26"))
FPS = 2.0
CLIPS = [(4, 640, 360), (9, 640, 360), (30, 640, 360), (4, 1280, 720), (30, 1280, 720)]
MESSAGES = user_message("What happens in the video?", 0, 1)
TESTS = Path(__file__).resolve().parent


def test_the_installed_transformers_is_one_the_parity_was_shown_for() -> None:
    low, high = PARITY_TRANSFORMERS
    assert low <= Version(transformers.__version__) < high, (
        f"transformers {transformers.__version__} is outside [{low}, {high}), where the video "
        "prompt layout and pixel cap were compared: run this module with it and move the range")


@pytest.fixture(scope="module")
def hf_clips(tiny_ckpt: Path, tmp_path_factory) -> dict[str, np.ndarray]:
    """transformers' outputs for every clip, from one worker process."""
    python = torchvision_python(cache_root())
    out = tmp_path_factory.mktemp("hf-video") / "hf.npz"
    spec = {"checkpoint": str(tiny_ckpt), "messages": MESSAGES, "fps": FPS, "clips": CLIPS}
    done = subprocess.run([str(python), str(TESTS / "hf_video_processor.py"), CALLER_SITE,
                           str(out)],
                          input=json.dumps(spec), capture_output=True, text=True,
                          cwd=TESTS, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as data:
        return dict(data)


def test_the_worker_runs_the_installed_transformers(hf_clips) -> None:
    assert str(hf_clips["transformers"]) == transformers.__version__


@pytest.mark.parametrize("index", range(len(CLIPS)),
                         ids=[f"{f}x{w}x{h}" for f, w, h in CLIPS])
def test_host_video_tensors_equal_the_hf_processor(tiny_ckpt: Path, hf_clips,
                                                   index: int) -> None:
    frames, width, height = CLIPS[index]
    pre = RequestPreprocessor.from_checkpoint(tiny_ckpt)
    ours = pre.prepare(messages=MESSAGES,
                       videos=[VideoFrames(png_frames(frames, width, height), fps=FPS)])
    (video,) = ours.videos
    assert hf_clips[f"grid_{index}"].tolist() == [list(video.grid_thw)]
    assert hf_clips[f"ids_{index}"].tolist() == ours.input_ids.tolist()
    assert float(hf_clips[f"off_{index}"]) < 1e-3  # their rows are 8-bit levels normalised
    rows = np.concatenate([g.pixel_values for g in video.groups]).astype(np.int16)
    difference = np.abs(hf_clips[f"levels_{index}"].astype(np.int16) - rows)
    print(f"\n{frames} frames {width}x{height}: grid {video.grid_thw}, "
          f"{ours.num_tokens} prompt ids equal; pixels: max {difference.max()} levels, "
          f"{np.mean(difference > 0):.2%} differ by one level")
    assert difference.max() <= 1, "pixel values differ by more than one 8-bit level"
