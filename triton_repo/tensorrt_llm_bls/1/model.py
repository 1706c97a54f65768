"""tensorrt_llm_bls (qvl-trt): the ensemble's inputs and outputs in one decoupled model that
runs preprocessing, vision_encoder and tensorrt_llm by BLS and detokenizes like
postprocessing. A client's cancel reaches it (the ensemble does not pass one to a running
step) and stops tensorrt_llm. Runs the qvl_trt code bundled beside it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.triton.contract import TensorrtLlmBlsParameters  # noqa: E402
from qvl_trt.triton.runtime.admission import Admission  # noqa: E402
from qvl_trt.triton.runtime.backend import exit_with_server, model_parameters  # noqa: E402
from qvl_trt.triton.runtime.llm_inputs import LlmInputs  # noqa: E402
from qvl_trt.triton.runtime.postprocessing import TokenStream  # noqa: E402
from qvl_trt.triton.runtime.tensorrt_llm_bls import Bls  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        params = TensorrtLlmBlsParameters.from_parameters(model_parameters(args),
                                                          args["model_name"])
        self.stream = TokenStream(
            HERE / "tokenizer.json",
            inputs=Bls(preprocessing=params.preprocessing_model,
                       vision_encoder=params.vision_encoder_model),
            llm_inputs=LlmInputs(params.mrope_table()),
            llm_model=params.tensorrt_llm_model, workers=params.workers,
            admission=Admission.of(params),
            model_name=args["model_name"], instance_name=args["model_instance_name"])

    def execute(self, requests):
        for request in requests:
            self.stream.submit(request)
        return None

    def finalize(self):
        self.stream.close()
