"""preprocessing (qvl-trt): chat messages or text + images -> token ids with fake prompt ids,
pixel patches, MRoPE table, sampling settings. Runs the qvl_trt code bundled beside it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.errors import QvlError  # noqa: E402
from qvl_trt.triton import contract  # noqa: E402
from qvl_trt.triton.runtime.backend import error_response, model_parameters, read_row, response  # noqa: E402
from qvl_trt.triton.runtime.preprocessing import PreprocessLimits, Preprocessor  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        limits = PreprocessLimits.from_parameters(model_parameters(args))
        self.preprocessor = Preprocessor(HERE / "checkpoint", limits)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                row = read_row(request, contract.PREPROCESSING_INPUTS)
                responses.append(response(self.preprocessor(row)))
            except QvlError as exc:
                responses.append(error_response(str(exc)))
        return responses
