"""Host index tensors of the vision engine vs transformers' own precompute helpers (the ones
its Qwen3-VL vision forward calls), and the I/O spec and profile patch range."""

from __future__ import annotations

import numpy as np
import pytest

from qvl_trt.checkpoint import VisionDims
from qvl_trt.errors import InputError
from qvl_trt.mm.geometry import smart_resize, video_pixel_budget, video_smart_resize
from qvl_trt.mm.vision_index import PIXEL_VALUES, vision_index_tensors
from qvl_trt.profiles import load_profile, profile_names
from qvl_trt.vision.spec import patch_range, vision_graph_spec

DIMS_2B = VisionDims(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                     out_hidden_size=2048, patch_size=16, temporal_patch_size=2,
                     spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
                     deepstack_visual_indexes=(5, 11, 17), hidden_act="gelu_pytorch_tanh")
# (h, w) patch grids: one block, wide, tall, odd block counts, 1080p, above the 48x48 table.
GRIDS = [(2, 2), (2, 200), (130, 34), (16, 16), (14, 22), (68, 120), (96, 96)]


@pytest.mark.parametrize("h,w", GRIDS)
def test_index_tensors_equal_transformers(h: int, w: int) -> None:
    torch = pytest.importorskip("torch")
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grid = torch.tensor([[1, h, w]])
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=48, mode="bilinear", align_corners=True, spatial_merge_size=2)
    positions = vision_utils.get_vision_position_ids(grid, 2)

    index = vision_index_tensors((1, h, w), DIMS_2B)

    assert index.num_patches == h * w
    assert index.pos_interp_indices.dtype == np.int32
    assert index.pos_interp_weights.dtype == np.float32
    assert index.rope_position_ids.dtype == np.int32
    # Bit-exact: the weights are computed in float32 the way transformers computes them.
    np.testing.assert_array_equal(index.pos_interp_indices, indices.numpy())
    np.testing.assert_array_equal(index.pos_interp_weights, weights.numpy())
    np.testing.assert_array_equal(index.rope_position_ids, positions.numpy())


def test_rows_are_merge_blocks() -> None:
    index = vision_index_tensors(np.array([[1, 4, 6]]), DIMS_2B)
    rows = index.rope_position_ids.reshape(-1, 4, 2)
    # Each 4 consecutive rows: one 2x2 block, (r, c), (r, c+1), (r+1, c), (r+1, c+1).
    assert rows[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert rows[1].tolist() == [[0, 2], [0, 3], [1, 2], [1, 3]]
    assert rows[3].tolist() == [[2, 0], [2, 1], [3, 0], [3, 1]]
    np.testing.assert_allclose(index.pos_interp_weights.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("grid,match", [
    ((2, 4, 4), "t=2"),
    ((1, 3, 4), "multiples of the spatial merge size"),
    ((1, 0, 4), "multiples of the spatial merge size"),
    ((1, 4), "three integers"),
    ((1.0, 4.0, 4.0), "three integers"),
])
def test_bad_grids_are_refused(grid, match: str) -> None:
    with pytest.raises(InputError, match=match):
        vision_index_tensors(grid, DIMS_2B)


def test_graph_spec_names_dtypes_and_axes() -> None:
    spec = vision_graph_spec(DIMS_2B, "float16")
    assert spec.input_names == ("pixel_values", "pos_interp_indices", "pos_interp_weights",
                                "rope_position_ids")
    assert spec.output_names == ("image_embeds", "deepstack_0", "deepstack_1", "deepstack_2")
    assert [t.dtype for t in spec.inputs] == ["uint8", "int32", "float32", "int32"]
    assert {t.dtype for t in spec.outputs} == {"float16"}
    assert spec.tensor("pixel_values").dims == (-1, 1536)
    assert spec.tensor("deepstack_2").dims == (-1, 2048)
    assert spec.tensor("image_embeds").shape == ("num_tokens", 2048)
    assert spec.tensor("rope_position_ids").shape == ("num_patches", 2)


def test_the_host_tensors_are_named_and_ordered_as_the_graph_takes_them() -> None:
    """The tower is called positionally with the pixels, then `as_dict()`'s values."""
    index = vision_index_tensors((1, 4, 6), DIMS_2B)
    spec = vision_graph_spec(DIMS_2B, "float16")
    assert spec.input_names == (PIXEL_VALUES, *index.as_dict())
    for name, array in index.as_dict().items():
        tensor = spec.tensor(name)
        assert array.dtype == tensor.dtype and array.shape == tensor.concrete({"num_patches": 24})


@pytest.mark.parametrize("name", profile_names())
def test_patch_range_covers_every_admitted_image(name: str) -> None:
    limits = load_profile(name).limits
    patches = patch_range(DIMS_2B, limits)
    assert patches.min % 4 == patches.opt % 4 == patches.max % 4 == 0
    assert patches.min <= patches.opt <= patches.max
    # Images the resize policy admits fall inside the engine's range.
    for h, w in [(32, 32), (256, 256), (720, 1280), (1080, 1920), (4000, 3000), (33, 2000),
                 (2000, 33), (511, 513)]:
        rh, rw = smart_resize(h, w, min_pixels=limits.vision_min_pixels,
                              max_pixels=limits.vision_max_pixels)
        assert patches.min <= (rh // 16) * (rw // 16) <= patches.max, (h, w)
    # So do a video's frames: frame counts from 2 to the profile's maximum, small and large.
    for frames in (2, 9, 30, limits.video_max_frames):
        for h, w in [(64, 32), (120, 160), (360, 640), (720, 1280), (2160, 3840)]:
            budget = video_pixel_budget(frames, min_pixels=0, max_pixels=limits.video_max_pixels,
                                        max_pixels_per_frame=limits.video_max_pixels_per_frame)
            rh, rw = video_smart_resize(frames, h, w, min_pixels=0, max_pixels=budget)
            assert patches.min <= (rh // 16) * (rw // 16) <= patches.max, (frames, h, w)
    shapes = patches.input_shapes(vision_graph_spec(DIMS_2B, "float16"))
    assert shapes["pos_interp_weights"] == ((patches.min, 4), (patches.opt, 4),
                                            (patches.max, 4))
