"""The vision step: a request's vision items -> its prompt table, item by item (an image, or
a video's temporal group: the tower attends within one), through the row cache. The served
vision_encoder model and the in-process pipeline both run it. The tower itself (TensorRT
engine or PyTorch) is passed in as a function."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoint, VisionDims
from ..dtypes import Dtype
from ..errors import InputError
from ..machine import pick_device
from ..mm.prompt_table import assemble_prompt_table, rows_per_visual_token
from ..mm.vision_index import VisionIndex, vision_index_tensors
from .cache import RowCache

# pixel_values [N, patch_dim] uint8 + the image's index tensors -> (image_embeds,
# deepstack_0, ..., deepstack_{K-1}), each [N / merge^2, hidden]
RunImage = Callable[[np.ndarray, VisionIndex], tuple[np.ndarray, ...]]


class VisionStep:
    def __init__(self, run_image: RunImage, vision: VisionDims, *, hidden_size: int,
                 table_dtype: np.dtype, cache: RowCache) -> None:
        self.run_image = run_image
        self.vision = vision
        self.hidden_size = hidden_size
        self.table_dtype = np.dtype(table_dtype)
        self.cache = cache

    def __call__(self, pixel_values: np.ndarray, grid_thw: np.ndarray,
                 image_hashes: np.ndarray) -> tuple[np.ndarray, int]:
        """The request's prompt table [(1+K) * visual tokens, hidden] and its row count. A
        request without images gets one token's worth of zero rows, which no input id
        references (ensembles have no conditional steps: every request passes here)."""
        grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        hashes = np.asarray(image_hashes, np.uint64).reshape(-1)
        sizes = [int(np.prod(g)) for g in grids]
        if len(hashes) != len(grids) or sum(sizes) != pixel_values.shape[0]:
            raise InputError(f"vision_encoder got {pixel_values.shape[0]} patch rows, "
                             f"{len(grids)} grids and {len(hashes)} hashes that do not agree; "
                             "send the preprocessing step's outputs unchanged")
        if not sizes:
            rows = rows_per_visual_token(self.vision.deepstack_count)
            return np.zeros((rows, self.hidden_size), self.table_dtype), rows
        tables, start = [], 0
        for grid, size, image_hash in zip(grids, sizes, hashes, strict=True):
            key = (int(image_hash), *map(int, grid))
            rows = self.cache.get(key)
            if rows is None:
                rows = self._encode(pixel_values[start : start + size], grid)
                self.cache.put(key, rows)
            tables.append(rows)
            start += size
        # One image: its (cached, read-only) rows are the table, not copied here.
        table = tables[0] if len(tables) == 1 else np.concatenate(tables)
        return table, int(table.shape[0])

    def _encode(self, pixel_values: np.ndarray, grid: np.ndarray) -> np.ndarray:
        index = vision_index_tensors(grid, self.vision)
        embeds, *deepstack = self.run_image(np.ascontiguousarray(pixel_values, np.uint8), index)
        if embeds.shape[-1] != self.hidden_size:
            raise InputError(f"the vision tower returned rows of width {embeds.shape[-1]}, the "
                             f"language model takes {self.hidden_size}")
        return assemble_prompt_table(np.asarray(embeds), [np.asarray(d) for d in deepstack],
                                     self.table_dtype)


def reference_tower(checkpoint: Checkpoint, *, device: str = "auto",
                    dtype: Dtype | str = Dtype.FLOAT32) -> RunImage:
    """The checkpoint's PyTorch vision tower (reference flavor, in-process pipeline)."""
    from ..deps import require
    from .tower import load_vision_tower

    torch = require("torch", extra="export", why="run the reference vision tower")
    device = pick_device(device)
    tower = load_vision_tower(checkpoint, dtype).to(device)

    def run(pixel_values: np.ndarray, index: VisionIndex) -> tuple[np.ndarray, ...]:
        # The tower's arguments are the graph's inputs in order: the pixels, then the index.
        args = [pixel_values, *index.as_dict().values()]
        with torch.inference_mode():
            outputs = tower(*(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                              for a in args))
        return tuple(o.float().cpu().numpy() for o in outputs)

    return run


def engine_tower(engine_dir: Path) -> RunImage:
    """The vision engine built by the vision stage (trt flavor; needs a CUDA GPU)."""
    from ..deps import require
    from .runner import VisionEngine

    torch = require("torch", extra="export", why="run the vision engine")
    engine = VisionEngine(engine_dir)
    names = [spec["name"] for spec in engine.config["outputs"]]

    def run(pixel_values: np.ndarray, index: VisionIndex) -> tuple[np.ndarray, ...]:
        outputs = engine(torch.from_numpy(pixel_values), index)
        return tuple(outputs[name].float().cpu().numpy() for name in names)

    return run
