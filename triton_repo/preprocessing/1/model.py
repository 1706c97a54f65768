"""preprocessing (qvl-trt): chat messages or text + images -> token ids with fake prompt ids,
pixel patches, MRoPE position ids, sampling settings. Runs the qvl_trt code bundled beside it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.triton import contract  # noqa: E402
from qvl_trt.triton.runtime.backend import (  # noqa: E402
    exit_with_server,
    model_parameters,
    read_row,
    run_requests,
)
from qvl_trt.triton.runtime.preprocessing import Preprocessor  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.name = args["model_name"]
        params = contract.PreprocessingParameters.from_parameters(model_parameters(args),
                                                                  self.name)
        self.preprocessor = Preprocessor(HERE / "checkpoint", params)

    def execute(self, requests):
        return run_requests(requests, self._handle, self.name)

    def _handle(self, request):
        return self.preprocessor(read_row(request, contract.PREPROCESSING_INPUTS))
