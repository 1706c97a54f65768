"""Cancellation and the stock backend's request contract on the session's real tritonserver
(`triton_server` in conftest.py): the reference tensorrt_llm refuses a request that does not
ask for both outputs, tensorrt_llm_bls answers like the ensemble, and a client that cancels
its tensorrt_llm_bls stream stops the generation."""

from __future__ import annotations

import queue

import numpy as np
import pytest
from test_triton_server import (
    ENSEMBLE_TYPES,
    RequestFailed,
    expected,
    grpc_ask,
    metric,
    pipeline,
    png,
)

from qvl_trt.triton import contract as c

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")
__all__ = ["pipeline"]  # the fixture, imported for pytest

TOKENS = "qvl_reference_llm_tokens_total"


def infer_input(name: str, value: np.ndarray, data_type: str):
    tensor = grpcclient.InferInput(name, list(value.shape), data_type)
    tensor.set_data_from_numpy(value)
    return tensor


def test_tensorrt_llm_refuses_a_request_without_sequence_length(triton_server) -> None:
    """The stock backend throws in fillTritonResponse unless both outputs are requested; so
    does the stand-in, before generating anything."""
    inputs = [infer_input(c.INPUT_IDS, np.array([[1, 2, 3]], np.int32), "INT32"),
              infer_input(c.INPUT_LENGTHS, np.array([[3]], np.int32), "INT32"),
              infer_input(c.REQUEST_OUTPUT_LEN, np.array([[2]], np.int32), "INT32")]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    try:
        client.async_stream_infer(c.TENSORRT_LLM, inputs,
                                  outputs=[grpcclient.InferRequestedOutput(c.OUTPUT_IDS)])
        error = results.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "sequence_length tensor must be present" in str(error)


def test_tensorrt_llm_bls_answers_like_the_ensemble(triton_server, pipeline) -> None:
    image = png(3)
    want = expected(pipeline, "What is in the picture?", [image])
    for stream in (True, False):
        ensemble = grpc_ask(triton_server, prompt="What is in the picture?", images=[image],
                            stream=stream)
        bls = grpc_ask(triton_server, prompt="What is in the picture?", images=[image],
                       stream=stream, model=c.TENSORRT_LLM_BLS)
        assert bls.text == ensemble.text == want.text
        assert (bls.prompt_tokens, bls.completion_tokens) == (ensemble.prompt_tokens,
                                                              ensemble.completion_tokens)
    with pytest.raises(RequestFailed, match="corrupt"):
        grpc_ask(triton_server, prompt="Hi", images=[png(1)[:60]], model=c.TENSORRT_LLM_BLS)


def test_a_cancelled_bls_stream_stops_the_generation(triton_server, pipeline) -> None:
    from qvl_trt.llm.sampling import FinishReason

    prompt, max_tokens, read = "Tell me a long story.", 400, 3
    assert expected(pipeline, prompt, max_tokens=max_tokens).finish_reason is FinishReason.LENGTH
    values = {c.TEXT_INPUT: np.array([[prompt.encode()]], object),
              c.MAX_TOKENS: np.array([[max_tokens]], np.int32),
              c.TEMPERATURE: np.array([[0.0]], np.float32), c.STREAM: np.array([[True]])}
    inputs = [infer_input(k, v, ENSEMBLE_TYPES[k])
              for k, v in values.items()]
    before = metric(triton_server, TOKENS)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(c.TENSORRT_LLM_BLS, inputs)
        for _ in range(read):
            result, error = results.get(timeout=120)
            assert error is None, error
        received = int(result.as_numpy(c.COMPLETION_TOKENS).reshape(-1)[0])
    finally:
        client.stop_stream(cancel_requests=True)  # the client's cancel
        client.close()
    # The server keeps serving; the cancelled request's batch has ended once a later request
    # is answered (the reference tensorrt_llm runs one batch at a time).
    follow = grpc_ask(triton_server, prompt="Still there?", max_tokens=4,
                      model=c.TENSORRT_LLM_BLS)
    assert follow.text == expected(pipeline, "Still there?", max_tokens=4).text
    total = metric(triton_server, TOKENS) - before
    again = metric(triton_server, TOKENS)
    grpc_ask(triton_server, prompt="Still there?", max_tokens=4, model=c.TENSORRT_LLM_BLS)
    follow_tokens = metric(triton_server, TOKENS) - again
    cancelled_tokens = total - follow_tokens
    print(f"cancelled after {received} tokens received; the reference tensorrt_llm made "
          f"{cancelled_tokens:.0f} in all, {cancelled_tokens - received:.0f} after the cancel "
          f"(of max_tokens {max_tokens})")
    assert received <= cancelled_tokens < max_tokens // 2, "the generation was not stopped"
