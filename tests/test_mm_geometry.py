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


def test_each_frame_gets_the_reference_cap_or_its_share_of_the_clip():
    kw = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_pixels_per_frame=2**21)
    per_frame = 768 * 32 * 32  # the reference cap: 768 merged tokens a frame
    # 4 frames could take 6.3 MP each of the clip's budget; the reference gives 768 tokens.
    assert video_pixel_budget(4, **kw) == 4 * per_frame
    assert video_pixel_budget(30, **kw) == 30 * per_frame
    # 60 frames: an even share of the clip's budget is below the cap.
    assert video_pixel_budget(60, **kw) == 60 * (MAX_PIXELS // 60)
    # A lower engine or deployment cap still binds; the floor is 1.05 x the clip's minimum.
    assert video_pixel_budget(4, **{**kw, "max_pixels_per_frame": 512 * 512}) == 4 * 512 * 512
    assert video_pixel_budget(4, **{**kw, "max_pixels": 2**20}) == 2**20
    assert video_pixel_budget(700, **{**kw, "max_pixels": 2**20}) == 2**20
    assert video_pixel_budget(4, **{**kw, "max_pixels": 2**20, "min_pixels": 2**19}) == 2**20
    assert video_pixel_budget(4, **kw, frame_token_cap=100) == 4 * 100 * 32 * 32
    # 4 frames of 2160x3840 become 640x1152 (20 x 36 tokens), 2 pairs.
    assert video_smart_resize(4, 2160, 3840, min_pixels=MIN_PIXELS, max_pixels=4 * per_frame) \
        == (640, 1152)
    assert video_token_count(4, 2160, 3840, **kw) == 2 * 20 * 36


def test_token_count_of_the_typical_clip_and_an_odd_frame_count():
    kw = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_pixels_per_frame=2**21)
    # 30 frames of 720x1280 are above 768 tokens each: 640x1152 (without the reference cap,
    # the clip's budget alone: 672x1216, 21 x 38).
    assert video_token_count(30, 720, 1280, **kw) == 15 * 20 * 36
    # 9 frames: the last is repeated to make 5 pairs; 360x640 -> 352x640 (11 x 20 tokens).
    assert video_token_count(9, 360, 640, **kw) == 5 * 11 * 20


@pytest.mark.parametrize("frames", [2, 3, 5, 7, 9, 30])
@pytest.mark.parametrize("size", [(704, 704), (1080, 1920)])
def test_no_frame_exceeds_the_cap_where_rounding_lowers_the_group_count(frames, size):
    """smart_resize compares the budget with the frame count rounded half-even to pairs
    (5 -> 4, 9 -> 8): a budget of cap x frames would let 5 frames of 704x704 keep their size,
    1.21 x the cap."""
    cap = 640 * 640
    budget = video_pixel_budget(frames, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                max_pixels_per_frame=cap)
    h, w = video_smart_resize(frames, *size, min_pixels=MIN_PIXELS, max_pixels=budget)
    assert h * w <= cap

