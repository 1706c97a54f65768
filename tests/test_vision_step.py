"""The vision step (qvl_trt/vision/step.py) over the tiny checkpoint's PyTorch tower: item by
item into the (1+K)-row layout, through the row cache; and its refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import InputError
from qvl_trt.machine import pick_device
from qvl_trt.mm.prompt_table import split_prompt_table
from qvl_trt.mm.vision_index import vision_index_tensors
from qvl_trt.vision.cache import RowCache
from qvl_trt.vision.step import VisionStep, reference_tower

GRIDS = ((1, 4, 4), (1, 2, 6))  # two items of different sizes (merge blocks of 2x2)


@pytest.fixture(scope="module")
def tower(tiny_ckpt: Path):
    """(checkpoint, its reference tower counting its calls, the calls' patch counts)."""
    ckpt = open_checkpoint(tiny_ckpt, validate=False)
    run = reference_tower(ckpt, device="cpu")
    calls = []

    def counted(pixel_values, index):
        calls.append(index.num_patches)
        return run(pixel_values, index)

    return ckpt, counted, calls


def _step(tower, capacity: int = 2**20, hidden: int | None = None) -> VisionStep:
    ckpt, run, _ = tower
    return VisionStep(run, ckpt.vision, hidden_size=hidden or ckpt.text.hidden_size,
                      table_dtype=np.float32, cache=RowCache(capacity))


def _items(ckpt, grids=GRIDS, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = sum(int(np.prod(g)) for g in grids)
    pixels = rng.integers(0, 256, (rows, ckpt.vision.patch_dim), np.uint8)
    return pixels, np.array(grids, np.int64), np.arange(1, len(grids) + 1, dtype=np.uint64)


def test_items_are_encoded_one_by_one_into_the_one_plus_k_row_layout(tower) -> None:
    ckpt, run, _ = tower
    pixels, grids, hashes = _items(ckpt)
    table, rows = _step(tower)(pixels, grids, hashes)
    k = ckpt.vision.deepstack_count
    tokens = sum(int(np.prod(g)) for g in GRIDS) // ckpt.vision.spatial_merge_size ** 2
    assert table.shape == (rows, ckpt.text.hidden_size) and rows == (1 + k) * tokens
    main, deepstack = split_prompt_table(table, k)
    start, token = 0, 0
    for grid in GRIDS:  # each item alone through the tower: its rows, in prompt order
        size = int(np.prod(grid))
        embeds, *features = run(pixels[start:start + size], vision_index_tensors(grid,
                                                                                 ckpt.vision))
        n = embeds.shape[0]
        np.testing.assert_array_equal(main[token:token + n], embeds)
        for got, want in zip(deepstack, features, strict=True):
            np.testing.assert_array_equal(got[token:token + n], want)
        start, token = start + size, token + n


def test_a_repeated_item_comes_from_the_cache_and_a_zero_cache_keeps_none(tower) -> None:
    ckpt, _, calls = tower
    pixels, grids, hashes = _items(ckpt, seed=1)
    step = _step(tower)
    first, _ = step(pixels, grids, hashes)
    before = len(calls)
    again, _ = step(pixels, grids, hashes)
    assert len(calls) == before and step.cache.stats().hits == len(GRIDS)
    np.testing.assert_array_equal(again, first)
    uncached = _step(tower, capacity=0)
    uncached(pixels, grids, hashes)
    uncached(pixels, grids, hashes)
    assert len(calls) == before + 2 * len(GRIDS) and uncached.cache.stats().entries == 0


def test_a_request_without_items_gets_one_token_of_zero_rows(tower) -> None:
    ckpt = tower[0]
    pixels = np.zeros((0, ckpt.vision.patch_dim), np.uint8)
    table, rows = _step(tower)(pixels, np.zeros((0, 3), np.int64), np.zeros(0, np.uint64))
    assert rows == 1 + ckpt.vision.deepstack_count
    assert table.shape == (rows, ckpt.text.hidden_size) and not table.any()


def test_disagreeing_inputs_and_a_tower_of_another_width_are_refused(tower) -> None:
    ckpt = tower[0]
    pixels, grids, hashes = _items(ckpt)
    with pytest.raises(InputError, match="do not agree; send the preprocessing step's"):
        _step(tower)(pixels[1:], grids, hashes)
    with pytest.raises(InputError, match="do not agree"):
        _step(tower)(pixels, grids, hashes[:1])
    width = ckpt.text.hidden_size
    with pytest.raises(InputError, match=f"width {width}, the language model takes {width + 1}"):
        _step(tower, hidden=width + 1)(pixels, grids, hashes)


def test_pick_device_resolves_auto_and_keeps_a_named_device() -> None:
    import torch

    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cuda:1") == "cuda:1"
