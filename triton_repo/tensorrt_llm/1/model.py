"""tensorrt_llm, reference flavor (qvl-trt): the stock TensorRT-LLM backend's inputs, outputs,
request contract and streaming behaviour, over the PyTorch reference decoder reading the
converted TensorRT-LLM checkpoint. Decoupled: tokens stream as they are generated. A cancelled
request, or one a stop request names, ends within a token. Tokens generated: the metric
qvl_reference_llm_tokens_total. Runs the qvl_trt code bundled beside it."""

import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

import json  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from qvl_trt.llm.reference import ReferenceDecoder  # noqa: E402
from qvl_trt.triton import contract as c  # noqa: E402
from qvl_trt.triton.runtime.backend import (  # noqa: E402
    error_response,
    guarded,
    model_parameters,
    pick_device,
    read_row,
    response,
)
from qvl_trt.triton.runtime.reference_tensorrt_llm import (  # noqa: E402
    LlmLimits,
    LlmRequest,
    ReferenceLlm,
    check_requested_outputs,
)

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
        self.name = args["model_name"]
        params = c.ReferenceLlmParameters.from_parameters(model_parameters(args), self.name)
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        decoder = ReferenceDecoder.load(HERE / "checkpoint", device=pick_device(params.device),
                                        dtype=params.dtype)
        self.limits = LlmLimits(hidden_size=decoder.config.hidden_size, table_dtype=params.dtype,
                                rows_per_request=params.prompt_table_rows_per_request)
        # The family must outlive its metric: keep both.
        self.family = pb_utils.MetricFamily(name="qvl_reference_llm_tokens_total",
                                            description="tokens the reference decoder made",
                                            kind=pb_utils.MetricFamily.COUNTER)
        self.tokens = self.family.Metric(labels={"model": self.name})
        self.llm = ReferenceLlm(decoder, max_batch_size=max_batch_size,
                                count_tokens=self.tokens.increment, model_name=self.name)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            guarded(self.name, partial(_fail, sender), self._submit, request, sender)
        return None

    def _submit(self, request, sender):
        row = read_row(request, c.LLM_INPUTS)
        if row.get(c.STOP_REQUEST):
            # The stock backend's handleStopRequest: an empty final response.
            self.llm.stop(request.request_id())
            sender.send(flags=FINAL)
            return
        check_requested_outputs(request.requested_output_names())
        self.llm.submit(LlmRequest.from_inputs(row, self.limits), partial(_emit, sender),
                        partial(_fail, sender), request_id=request.request_id(),
                        is_cancelled=request.is_cancelled)

    def finalize(self):
        self.llm.close()
