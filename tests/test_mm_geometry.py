"""The video resize policy against transformers' own (the Qwen3-VL video processor's
smart_resize), and the token counts the planner states with it."""

from __future__ import annotations

import itertools

import pytest

from qvl_trt.errors import InputError
from qvl_trt.mm.geometry import video_pixel_budget, video_smart_resize, video_token_count

# Qwen3-VL's released video_preprocessor_config.json: size.{shortest,longest}_edge.
MIN_PIXELS, MAX_PIXELS = 4096, 25165824


def test_video_resize_matches_transformers():
    hf = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    sizes = [(16, 16), (20, 700), (120, 160), (360, 640), (361, 641), (720, 1280),
             (1080, 1920), (2160, 3840), (1000, 33)]
    budgets = [(MIN_PIXELS, MAX_PIXELS), (4096, 2 * 2**20), (2**20, 2**22)]
    checked = 0
    for frames, (h, w), (lo, hi) in itertools.product((2, 3, 4, 9, 30, 64, 768), sizes, budgets):
        theirs = hf.smart_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=lo,
                                 max_pixels=hi)
        assert video_smart_resize(frames, h, w, min_pixels=lo, max_pixels=hi) == theirs, \
            (frames, h, w, lo, hi)
        checked += 1
    assert checked == 7 * 9 * 3


def test_a_video_needs_two_frames():
    with pytest.raises(InputError, match="video has 1 frame"):
        video_smart_resize(1, 720, 1280, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def test_the_frame_cap_binds_only_on_short_clips():
    # 30 frames share the budget: 838860 pixels each, below a 2 MP frame cap.
    assert video_pixel_budget(30, max_pixels=MAX_PIXELS, max_pixels_per_frame=2**21) == MAX_PIXELS
    # 4 frames would get 6.3 MP each; the vision engine takes 2 MP per call.
    assert video_pixel_budget(4, max_pixels=MAX_PIXELS, max_pixels_per_frame=2**21) == 4 * 2**21
    # 4 frames of 2160x3840 then become 1056x1920 (33 x 60 tokens), 2 pairs.
    assert video_smart_resize(4, 2160, 3840, min_pixels=MIN_PIXELS, max_pixels=4 * 2**21) == \
        (1056, 1920)
    assert video_token_count(4, 2160, 3840, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                             max_pixels_per_frame=2**21) == 2 * 33 * 60


def test_token_count_of_the_typical_clip_and_an_odd_frame_count():
    kw = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_pixels_per_frame=2**21)
    assert video_token_count(30, 720, 1280, **kw) == 15 * 21 * 38
    # 9 frames: the last is repeated to make 5 pairs; 360x640 -> 352x640 (11 x 20 tokens).
    assert video_token_count(9, 360, 640, **kw) == 5 * 11 * 20


@pytest.mark.parametrize("frames", [2, 3, 5, 7, 9, 30])
@pytest.mark.parametrize("size", [(704, 704), (1080, 1920)])
def test_no_frame_exceeds_the_cap_where_rounding_lowers_the_group_count(frames, size):
    """smart_resize compares the budget with the frame count rounded half-even to pairs
    (5 -> 4, 9 -> 8): a budget of cap x frames would let 5 frames of 704x704 keep their size,
    1.21 x the cap."""
    cap = 640 * 640
    budget = video_pixel_budget(frames, max_pixels=MAX_PIXELS, max_pixels_per_frame=cap)
    h, w = video_smart_resize(frames, *size, min_pixels=MIN_PIXELS, max_pixels=budget)
    assert h * w <= cap

