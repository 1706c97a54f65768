"""Rope index equal to HF `Qwen3VLModel.get_rope_index`; the MRoPE table in TensorRT-LLM's
layout reconstructs HF's text rotary embedding (cos, sin) per token."""

from __future__ import annotations

import numpy as np
import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import InputError
from qvl_trt.mm.chat import PromptBuilder
from qvl_trt.mm.rope import mrope_cos_sin_table, mrope_slot_axes, rope_index

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-6

TEXT = {"type": "text", "text": "What differs between these pictures? Answer briefly."}
IMAGE = {"type": "image"}
# id -> (user content parts, image grids (t, h, w) in patches)
PROMPTS = {
    "text-only": ([TEXT], []),
    "one-image": ([IMAGE, TEXT], [(1, 16, 16)]),
    "image-last": ([TEXT, IMAGE], [(1, 12, 20)]),
    "image-between": ([TEXT, IMAGE, TEXT], [(1, 34, 6)]),
    "images-of-different-sizes": ([IMAGE, TEXT, IMAGE, TEXT, IMAGE],
                                  [(1, 16, 16), (1, 4, 126), (1, 40, 22)]),
    "images-back-to-back": ([IMAGE, IMAGE, TEXT], [(1, 8, 8), (1, 10, 6)]),
}


def cos_sin_from_table(table: np.ndarray, num_tokens: int, head_dim: int) \
        -> tuple[np.ndarray, np.ndarray]:
    """Per-token (cos, sin), each [num_tokens, head_dim] in HF's layout (the half repeated),
    read from an `mrope_rotary_cos_sin` table the way the context-phase kernel reads it."""
    pairs = np.asarray(table).reshape(-1, head_dim // 2, 2)[:num_tokens]
    cos, sin = pairs[..., 0], pairs[..., 1]
    return np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return open_checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def prompts(ckpt):
    return PromptBuilder.from_checkpoint(ckpt.path, ckpt.token_ids)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    """Qwen3VLModel on the meta device: get_rope_index needs the config, not weights."""
    config = transformers.Qwen3VLConfig.from_pretrained(str(ckpt.path))
    with torch.device("meta"):
        return transformers.Qwen3VLModel(config)


def _ids(prompts, parts, grids):
    text, *_ = prompts.render([{"role": "user", "content": parts}])
    return prompts.tokenize(text, [h * w // 4 for _, h, w in grids])


def test_video_rope_index_equals_hf(ckpt, prompts, hf_model):
    """A video of 3 temporal groups of 6x10 patches between two images: each group is placed
    as an image of grid (1, h, w) after its timestamp (our video pads are image pads past the
    tokenizer), as HF's get_rope_index splits video grids."""
    parts = [IMAGE, {"type": "video"}, TEXT, IMAGE]
    text, *_ = prompts.render([{"role": "user", "content": parts}])
    groups = [("<0.2 seconds>", 15), ("<1.2 seconds>", 15), ("<2.0 seconds>", 15)]
    ids = prompts.tokenize(text, [16, 6], [groups])
    video = ckpt.token_ids.video
    as_images = np.where(ids == video, ckpt.token_ids.image, ids)
    grids = [(1, 8, 8), (1, 6, 10), (1, 6, 10), (1, 6, 10), (1, 4, 6)]
    ours = rope_index(as_images, grids, image_token_id=ckpt.token_ids.image,
                      spatial_merge_size=2)
    ids_t = torch.tensor(ids[None], dtype=torch.long)
    types = (ids_t == ckpt.token_ids.image).int() + 2 * (ids_t == video).int()
    hf_pos, hf_delta = hf_model.get_rope_index(
        ids_t, types, image_grid_thw=torch.tensor([(1, 8, 8), (1, 4, 6)]),
        video_grid_thw=torch.tensor([(3, 6, 10)]))
    assert np.array_equal(ours.position_ids, hf_pos[:, 0].numpy())
    assert ours.delta == int(hf_delta[0, 0])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_rope_index_equals_hf(name, ckpt, prompts, hf_model):
    parts, grids = PROMPTS[name]
    ids = _ids(prompts, parts, grids)
    ours = rope_index(ids, grids, image_token_id=ckpt.token_ids.image, spatial_merge_size=2)
    ids_t = torch.tensor(ids[None], dtype=torch.long)
    hf_pos, hf_delta = hf_model.get_rope_index(
        ids_t, (ids_t == ckpt.token_ids.image).int(),
        image_grid_thw=torch.tensor(grids, dtype=torch.long) if grids else None)
    assert ours.position_ids.dtype == np.int64
    assert np.array_equal(ours.position_ids, hf_pos[:, 0].numpy())
    assert ours.delta == int(hf_delta.reshape(-1)[0])
    if grids:
        assert ours.delta < 0  # images take fewer positions than tokens


def test_rope_index_refuses_mismatched_grids(ckpt, prompts):
    ids = _ids(prompts, [IMAGE, TEXT], [(1, 16, 16)])
    with pytest.raises(InputError, match="does not match grid"):
        rope_index(ids, [(1, 8, 8)], image_token_id=ckpt.token_ids.image, spatial_merge_size=2)
    with pytest.raises(InputError, match="1 image token runs but 2 image grids"):
        rope_index(ids, [(1, 16, 16)] * 2, image_token_id=ckpt.token_ids.image,
                   spatial_merge_size=2)


def test_interleaved_slot_axes_of_the_released_models():
    axes = mrope_slot_axes((24, 20, 20), interleaved=True)
    assert axes.tolist() == [0, 1, 2] * 20 + [0] * 4
    assert np.bincount(axes).tolist() == [24, 20, 20]
    assert mrope_slot_axes((16, 24, 24), interleaved=False).tolist() == [0] * 16 + [1] * 24 + [2] * 24


def _hf_cos_sin(config, position_ids: np.ndarray):
    rotary = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.from_numpy(position_ids)[:, None, :])
    return cos[0].numpy(), sin[0].numpy()


def test_table_reconstructs_hf_rotary(ckpt, prompts):
    parts, grids = PROMPTS["images-of-different-sizes"]
    ids = _ids(prompts, parts + [TEXT] * 20, grids)
    pos = rope_index(ids, grids, image_token_id=ckpt.token_ids.image,
                     spatial_merge_size=2).position_ids
    max_positions = 2048
    table = mrope_cos_sin_table(pos, ckpt.text, max_positions)
    assert table.dtype == np.float32 and table.shape == (max_positions * ckpt.text.head_dim,)
    cos, sin = cos_sin_from_table(table, ids.size, ckpt.text.head_dim)
    config = transformers.Qwen3VLConfig.from_pretrained(str(ckpt.path)).text_config
    hf_cos, hf_sin = _hf_cos_sin(config, pos)
    assert float(np.abs(cos - hf_cos).max()) <= TOL
    assert float(np.abs(sin - hf_sin).max()) <= TOL
    # Rows past the prompt are position 0: (cos, sin) = (1, 0), as TensorRT-LLM pads.
    rest = table.reshape(max_positions, -1, 2)[ids.size:]
    assert np.all(rest[..., 0] == 1) and np.all(rest[..., 1] == 0)


@pytest.mark.parametrize("text_tokens", [450, 7700])
def test_table_reconstructs_hf_rotary_at_released_dims(tmp_path, text_tokens):
    """head_dim 128, theta 5e6, sections [24, 20, 20] (2B): a 20x20 image after 10 text
    tokens, then text. The inverse frequencies are TensorRT-LLM's; torch's differ by one
    float32 ulp in slot 19 (angle off by < 1e-9 per position), so beyond ~500 positions the
    bound grows by 1e-9 per position."""
    from qvl_trt.testing.tiny_checkpoint import write_config_only

    path = write_config_only(tmp_path / "2b", "2b")
    text = open_checkpoint(path).text
    grid = np.stack(np.meshgrid(np.arange(20), np.arange(20), indexing="ij"), 0).reshape(2, -1)
    pos = np.concatenate([
        np.broadcast_to(np.arange(10), (3, 10)),
        np.concatenate([np.full((1, 400), 10), 10 + grid]),
        np.broadcast_to(np.arange(30, 30 + text_tokens), (3, text_tokens))], axis=1)
    pos = pos.astype(np.int64)
    cos, sin = cos_sin_from_table(mrope_cos_sin_table(pos, text, 8192), pos.shape[1], 128)
    config = transformers.Qwen3VLConfig.from_pretrained(str(path)).text_config
    hf_cos, hf_sin = _hf_cos_sin(config, pos)
    tol = max(TOL, 2.4e-7 + 1e-9 * int(pos.max()))
    assert float(np.abs(cos - hf_cos).max()) <= tol
    assert float(np.abs(sin - hf_sin).max()) <= tol


def test_table_is_bounded_by_the_engine_positions(ckpt):
    pos = np.broadcast_to(np.arange(100), (3, 100)).astype(np.int64)
    with pytest.raises(InputError, match="prompt has 100 tokens but the MRoPE table holds 64"):
        mrope_cos_sin_table(pos, ckpt.text, 64)
