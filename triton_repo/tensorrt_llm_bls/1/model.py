"""tensorrt_llm_bls (qvl-trt): the ensemble's inputs and outputs in one decoupled model that
runs preprocessing, vision_encoder and tensorrt_llm by BLS and detokenizes like
postprocessing. A client's cancel reaches it (the ensemble does not pass one to a running
step) and stops tensorrt_llm. Runs the qvl_trt code bundled beside it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.triton.model_configs import (  # noqa: E402
    LLM_MODEL_PARAMETER,
    PREPROCESSING_MODEL_PARAMETER,
    VISION_MODEL_PARAMETER,
    WORKERS_PARAMETER,
)
from qvl_trt.triton.runtime.backend import model_parameters  # noqa: E402
from qvl_trt.triton.runtime.postprocessing import Postprocessor  # noqa: E402
from qvl_trt.triton.runtime.tensorrt_llm_bls import Bls  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        postprocessor = Postprocessor(HERE / "tokenizer.json",
                                      llm_model=params[LLM_MODEL_PARAMETER],
                                      workers=int(params[WORKERS_PARAMETER]))
        self.bls = Bls(postprocessor, preprocessing=params[PREPROCESSING_MODEL_PARAMETER],
                       vision_encoder=params[VISION_MODEL_PARAMETER])

    def execute(self, requests):
        for request in requests:
            self.bls.submit(request)
        return None

    def finalize(self):
        self.bls.close()
