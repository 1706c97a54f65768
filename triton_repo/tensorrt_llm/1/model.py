"""tensorrt_llm, reference flavor (qvl-trt): the stock TensorRT-LLM backend's inputs, outputs,
request contract and streaming behaviour, over the PyTorch reference decoder reading the
converted TensorRT-LLM checkpoint. Decoupled: tokens stream as they are generated. A cancelled
request, or one a stop request names, ends within a token. Publishes the stock backend's
metrics (nv_trt_llm_request_metrics, nv_trt_llm_general_metrics, ...). Runs the qvl_trt code
bundled beside it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.llm.reference import ReferenceDecoder  # noqa: E402
from qvl_trt.machine import pick_device  # noqa: E402
from qvl_trt.triton.runtime.backend import exit_with_server  # noqa: E402
from qvl_trt.triton.runtime.reference_tensorrt_llm import LlmModel  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.model = LlmModel.load(args, lambda params: ReferenceDecoder.load(
            HERE / "checkpoint", device=pick_device(params.device), dtype=params.dtype))

    def execute(self, requests):
        self.model.execute(requests)
        return None

    def finalize(self):
        self.model.close()
