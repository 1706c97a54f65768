"""vision_encoder (qvl-trt): pixel patches -> prompt-table rows (main + DeepStack rows per
visual token), through an LRU cache keyed by image content. Runs the TensorRT vision engine
(trt flavor) or the PyTorch tower (reference flavor) with the qvl_trt code bundled beside it.
Cache hits and misses are Triton metrics: qvl_vision_cache_{hits,misses}_total."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from qvl_trt.checkpoint import open_checkpoint  # noqa: E402
from qvl_trt.triton import contract as c  # noqa: E402
from qvl_trt.triton.runtime.backend import model_parameters, read_row, run_requests  # noqa: E402
from qvl_trt.triton.runtime.vision_cache import RowCache  # noqa: E402
from qvl_trt.triton.runtime.vision_encoder import VisionStep, engine_tower, reference_tower  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        params = c.VisionEncoderParameters.from_parameters(model_parameters(args), self.name)
        checkpoint = open_checkpoint(HERE / "checkpoint", validate=False)
        if params.flavor is c.Flavor.REFERENCE:
            run_image = reference_tower(HERE / "checkpoint", device=params.device,
                                        dtype=params.dtype)
        else:
            run_image = engine_tower(HERE / "engine")
        table_config = pb_utils.get_output_config_by_name(json.loads(args["model_config"]),
                                                          c.PROMPT_EMBEDDING_TABLE)
        table_dtype = pb_utils.triton_string_to_numpy(table_config["data_type"])
        self.step = VisionStep(run_image, checkpoint.vision,
                               hidden_size=checkpoint.text.hidden_size, table_dtype=table_dtype,
                               cache=RowCache(params.cache_bytes))
        # The families must outlive their metrics: keep both.
        labels = {"model": self.name}
        self.families = [
            pb_utils.MetricFamily(name="qvl_vision_cache_hits_total",
                                  description="images served from the vision cache",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="qvl_vision_cache_misses_total",
                                  description="images run through the vision tower",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="qvl_vision_cache_bytes",
                                  description="bytes of prompt-table rows in the vision cache",
                                  kind=pb_utils.MetricFamily.GAUGE),
        ]
        self.hits, self.misses, self.cached_bytes = (f.Metric(labels=labels)
                                                     for f in self.families)
        self.seen = (0, 0)

    def execute(self, requests):
        responses = run_requests(requests, self._handle, self.name)
        stats = self.step.cache.stats()
        self.hits.increment(stats.hits - self.seen[0])
        self.misses.increment(stats.misses - self.seen[1])
        self.cached_bytes.set(stats.bytes)
        self.seen = (stats.hits, stats.misses)
        return responses

    def _handle(self, request):
        row = read_row(request, c.VISION_INPUTS)
        table, rows = self.step(row[c.PIXEL_VALUES], row[c.IMAGE_GRID_THW], row[c.IMAGE_HASHES])
        return {c.PROMPT_EMBEDDING_TABLE: table, c.PROMPT_VOCAB_SIZE: np.array([rows], np.int32)}
