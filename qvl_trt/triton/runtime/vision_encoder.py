"""The vision_encoder python model's body: the flavor's tower (the TensorRT vision engine, or
the PyTorch tower for the reference flavor) under the vision step (qvl_trt/vision/step.py),
its row cache counted in Triton metrics qvl_vision_cache_{hits,misses}_total and
qvl_vision_cache_bytes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint import open_checkpoint
from ...vision.cache import RowCache
from ...vision.step import VisionStep, engine_tower, reference_tower
from .. import contract as c
from .backend import model_parameters, pb, read_row, run_requests


class VisionEncoderModel:
    def __init__(self, args: Mapping[str, str], *, checkpoint_dir: Path,
                 engine_dir: Path) -> None:
        """The model of Triton's initialize(args), over the checkpoint and vision engine
        folders beside its model.py."""
        self.name = args["model_name"]
        params = c.VisionEncoderParameters.from_parameters(model_parameters(args), self.name)
        checkpoint = open_checkpoint(checkpoint_dir, validate=False)
        if params.flavor is c.Flavor.REFERENCE:
            run_image = reference_tower(checkpoint, device=params.device, dtype=params.dtype)
        else:
            run_image = engine_tower(engine_dir)
        table_config = pb().get_output_config_by_name(json.loads(args["model_config"]),
                                                      c.PROMPT_EMBEDDING_TABLE)
        table_dtype = pb().triton_string_to_numpy(table_config["data_type"])
        self.step = VisionStep(run_image, checkpoint.vision,
                               hidden_size=checkpoint.text.hidden_size, table_dtype=table_dtype,
                               cache=RowCache(params.cache_bytes))
        # The families must outlive their metrics: keep both.
        labels = {"model": self.name}
        family = pb().MetricFamily
        self.families = [
            family(name=c.VISION_CACHE_HITS,
                   description="images served from the vision cache", kind=family.COUNTER),
            family(name=c.VISION_CACHE_MISSES,
                   description="images run through the vision tower", kind=family.COUNTER),
            family(name=c.VISION_CACHE_BYTES,
                   description="bytes of prompt-table rows in the vision cache",
                   kind=family.GAUGE),
        ]
        self.hits, self.misses, self.cached_bytes = (f.Metric(labels=labels)
                                                     for f in self.families)
        self.seen = (0, 0)

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        responses = run_requests(requests, self._handle, self.name)
        stats = self.step.cache.stats()
        self.hits.increment(stats.hits - self.seen[0])
        self.misses.increment(stats.misses - self.seen[1])
        self.cached_bytes.set(stats.bytes)
        self.seen = (stats.hits, stats.misses)
        return responses

    def _handle(self, request: Any) -> dict[str, np.ndarray]:
        row = read_row(request, c.VISION_INPUTS)
        table, rows = self.step(row[c.PIXEL_VALUES], row[c.IMAGE_GRID_THW], row[c.IMAGE_HASHES])
        return {c.PROMPT_EMBEDDING_TABLE: table, c.PROMPT_VOCAB_SIZE: np.array([rows], np.int32)}
