"""The gateway's reading of the deployment's error responses (qvl_trt/gateway/upstream.py):
each kind of failure a python model raises reaches the client with its HTTP status."""

from __future__ import annotations

import pytest

from qvl_trt.errors import (
    BusyError,
    EngineLimitError,
    InputError,
    LimitError,
    UnavailableError,
)
from qvl_trt.gateway.upstream import refusal
from qvl_trt.triton import contract as c
from qvl_trt.triton.runtime.backend import guarded


@pytest.mark.parametrize("exc, status, code", [
    (InputError("prompt is too long; shorten it"), 400, None),
    (LimitError("the number of stop strings is 17, above the limit of 16 (the preprocessing "
                "model's max_stop_words parameter); send fewer stop strings"), 413,
     "request_too_large"),
    (EngineLimitError("prompt has 900 tokens (0 of them for 0 images), the engine allows 768: "
                      "shorten the text or send fewer or smaller images"), 400, None),
    (UnavailableError("the model is unloading; send the request again once the server is "
                      "back"), 503, "unavailable"),
    (BusyError("tensorrt_llm has 8 batch slots and 8 places in its queue (the repository's "
               "max_queue), all taken; send the request again later"), 429,
     "rate_limit_exceeded"),
    (KeyError("secret"), 500, None),
])
def test_each_kind_goes_from_raise_to_wire_text_to_status(exc, status, code) -> None:
    def fail(_):
        raise exc

    sent: list[str] = []
    guarded("b4_preprocessing", sent.append, fail, None)
    answer = refusal(sent[0])
    assert (answer.status, answer.code) == (status, code)
    assert answer.type == {429: "rate_limit_exceeded"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    # postprocessing passes tensorrt_llm's error on (its marker first, then the step's name),
    # Triton prefixes an ensemble's: the kind stays.
    relayed = c.ErrorKind.relay(sent[0], "b4_tensorrt_llm")
    assert refusal(f"in ensemble 'b4_ensemble', {relayed}").status == status


@pytest.mark.parametrize("text", [
    "Failed to process the request(s) for model 'b4_preprocessing', message: Stub process "
    "'b4_preprocessing_0_0' is not healthy.",
    "Request for unknown model: 'tensorrt_llm_bls' is not found",
    "model 'b4_vision_encoder' is not ready",
])
def test_tritons_own_words_for_a_model_not_there_now_are_503(text: str) -> None:
    assert refusal(text).status == 503


def _response(outputs: dict) -> object:
    """A ModelInferResponse (tritonclient's protobuf) with these outputs as Triton sends them:
    raw little-endian contents, a BYTES element as its 4-byte length and the bytes."""
    import numpy as np

    pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    response = pb2.ModelInferResponse()
    for name, value in outputs.items():
        response.outputs.add(name=name)
        if isinstance(value, str):
            raw = len(value.encode()).to_bytes(4, "little") + value.encode()
        else:
            raw = np.array([value], np.int32).tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_usage_reports_the_visual_tokens_a_repository_sends_and_none_it_does_not() -> None:
    """A repository with the image_tokens and video_tokens outputs: usage names them under
    prompt_tokens_details; one written before them: usage without details (not zeros, which
    would claim a text-only prompt)."""
    from qvl_trt.gateway.openai_api import usage
    from qvl_trt.gateway.upstream import _piece

    old = {c.TEXT_OUTPUT: "Hi", c.PROMPT_TOKENS: 80, c.COMPLETION_TOKENS: 1,
           c.FINISH_REASON: ""}
    piece = _piece(_response(old))
    assert piece.media_tokens is None
    assert usage(piece.prompt_tokens, 1, piece.media_tokens) == {
        "prompt_tokens": 80, "completion_tokens": 1, "total_tokens": 81}
    new = _piece(_response({**old, c.IMAGE_TOKENS: 60, c.VIDEO_TOKENS: 8}))
    assert new.media_tokens == (60, 8)
    assert usage(new.prompt_tokens, 1, new.media_tokens)["prompt_tokens_details"] == {
        "image_tokens": 60, "video_tokens": 8}
