"""tensorrt_llm, reference flavor (qvl-trt): the stock TensorRT-LLM backend's inputs and
outputs and its streaming behaviour, over the PyTorch reference decoder reading the
converted TensorRT-LLM checkpoint. Decoupled: tokens stream as they are generated. Runs the
qvl_trt code bundled beside it."""

import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

import json  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from qvl_trt.errors import QvlError  # noqa: E402
from qvl_trt.llm.reference import ReferenceDecoder  # noqa: E402
from qvl_trt.triton import contract as c  # noqa: E402
from qvl_trt.triton.pb_io import error_response, model_parameters, read_row, response  # noqa: E402
from qvl_trt.triton.reference_llm import LlmRequest, ReferenceLlm  # noqa: E402
from qvl_trt.triton.vision_step import pick_device  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _emit(sender, tokens, final):
    ids = np.array([tokens], np.int32)  # (beam, tokens)
    sender.send(response({c.OUTPUT_IDS: ids,
                          c.SEQUENCE_LENGTH: np.array([len(tokens)], np.int32)}),
                flags=FINAL if final else 0)


def _fail(sender, message):
    sender.send(error_response(message), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        decoder = ReferenceDecoder.load(HERE / "checkpoint", device=pick_device(params["device"]),
                                        dtype=params["dtype"])
        self.llm = ReferenceLlm(decoder, max_batch_size=max_batch_size)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.llm.submit(LlmRequest.from_inputs(read_row(request, c.LLM_INPUTS)),
                                partial(_emit, sender), partial(_fail, sender))
            except QvlError as exc:
                _fail(sender, str(exc))
        return None

    def finalize(self):
        self.llm.close()
