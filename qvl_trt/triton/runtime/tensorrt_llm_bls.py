"""The tensorrt_llm_bls model: the ensemble's API in one decoupled python model.

It runs preprocessing and vision_encoder by BLS (`Bls`, the inputs of its TokenStream) and
then the token path postprocessing runs too (`TokenStream`: tensorrt_llm by BLS, detokenized
as it streams), in its own worker pool.
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

from ...errors import StepError
from .. import contract as c
from .backend import pb


class Bls:
    """A request's tensors for tensorrt_llm, made by running its earlier steps by BLS (the
    `inputs` of the model's TokenStream)."""

    def __init__(self, *, preprocessing: str, vision_encoder: str) -> None:
        self.preprocessing = preprocessing
        self.vision_encoder = vision_encoder

    def __call__(self, request: Any) -> dict[str, Any]:
        inputs = [t for t in (pb().get_input_tensor_by_name(request, s.name)
                              for s in c.ENSEMBLE_INPUTS) if t is not None]
        tensors = _call(self.preprocessing, inputs, c.PREPROCESSING_OUTPUTS)
        tensors |= _call(self.vision_encoder, [tensors[s.name] for s in c.VISION_INPUTS],
                         c.VISION_OUTPUTS)
        tensors |= {name: pb().get_input_tensor_by_name(request, name) for name in c.FROM_PUBLIC}
        return {s.name: tensors[s.name] for s in c.POSTPROCESSING_INPUTS}


def _call(model: str, inputs: list[Any], outputs: Sequence[c.TensorSpec]) -> dict[str, Any]:
    """One non-decoupled BLS call: output name -> tensor. The step's error is passed on with
    its kind (contract.ErrorKind.relay)."""
    result = pb().InferenceRequest(model_name=model, inputs=inputs,
                                   requested_output_names=[s.name for s in outputs]).exec()
    if result.has_error():
        raise StepError(c.ErrorKind.relay(result.error().message(), model))
    return {s.name: pb().get_output_tensor_by_name(result, s.name) for s in outputs}
