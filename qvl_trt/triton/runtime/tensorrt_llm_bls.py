"""The tensorrt_llm_bls model: the ensemble's API in one decoupled python model.

It runs preprocessing and vision_encoder by BLS and then postprocessing's loop
(`Postprocessor.generate`: tensorrt_llm by BLS, detokenized as it streams) on its own thread.
Why it exists: Triton's ensemble scheduler passes a client's cancel only to steps not yet
started (core ensemble_scheduler.cc; server issue #6739), so a cancelled ensemble request
keeps its postprocessing step, and tensorrt_llm, generating to max_tokens. Here the request
the client cancels is this model's own: `request.is_cancelled()` turns true (the loop asks
it as tokens arrive, at most every CANCEL_CHECK_S, for a non-streamed answer too: tensorrt_llm
always streams to the loop) and tensorrt_llm is stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InputError
from .. import contract as c
from .backend import pb
from .postprocessing import Postprocessor


class Bls:
    def __init__(self, postprocessor: Postprocessor, *, preprocessing: str,
                 vision_encoder: str) -> None:
        self.postprocessor = postprocessor
        self.preprocessing = preprocessing
        self.vision_encoder = vision_encoder

    def submit(self, request: Any) -> None:
        self.postprocessor.submit(request, self._run)

    def close(self) -> None:
        self.postprocessor.close()

    def _run(self, request: Any, sender: Any) -> None:
        inputs = [t for t in (pb().get_input_tensor_by_name(request, s.name)
                              for s in c.ENSEMBLE_INPUTS) if t is not None]
        tensors = _call(self.preprocessing, inputs, c.PREPROCESSING_OUTPUTS)
        tensors |= _call(self.vision_encoder, [tensors[s.name] for s in c.VISION_INPUTS],
                         c.VISION_OUTPUTS)
        llm_inputs = self.postprocessor.llm_inputs(
            {s.name: tensors[s.name] for s in c.POSTPROCESSING_INPUTS})
        self.postprocessor.generate(llm_inputs, sender, request.is_cancelled)


def _call(model: str, inputs: list[Any], outputs: Sequence[c.TensorSpec]) -> dict[str, Any]:
    """One non-decoupled BLS call: output name -> tensor. The step's error is passed on as it
    is (an InputError of its text, which carries its kind's marker, contract.ErrorKind)."""
    result = pb().InferenceRequest(model_name=model, inputs=inputs,
                                   requested_output_names=[s.name for s in outputs]).exec()
    if result.has_error():
        raise InputError(result.error().message())
    return {s.name: pb().get_output_tensor_by_name(result, s.name) for s in outputs}
