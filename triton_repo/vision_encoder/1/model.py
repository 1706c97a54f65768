"""vision_encoder (qvl-trt): pixel patches -> prompt-table rows (main + DeepStack rows per
visual token), through an LRU cache keyed by image content. Runs the TensorRT vision engine
(trt flavor) or the PyTorch tower (reference flavor) with the qvl_trt code bundled beside it.
Cache hits and misses are Triton metrics: qvl_vision_cache_{hits,misses}_total."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.triton.runtime.backend import exit_with_server  # noqa: E402
from qvl_trt.triton.runtime.vision_encoder import VisionEncoderModel  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.model = VisionEncoderModel(args, checkpoint_dir=HERE / "checkpoint",
                                        engine_dir=HERE / "engine")

    def execute(self, requests):
        return self.model.execute(requests)
