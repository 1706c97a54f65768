"""Cancellation and the stock backend's request contract on the session's real tritonserver
(`triton_server` in conftest.py): the reference tensorrt_llm refuses a request that does not
ask for both outputs, tensorrt_llm_bls answers like the ensemble, and a client that cancels
its tensorrt_llm_bls request, streamed or not, stops the generation."""

from __future__ import annotations

import dataclasses
import queue
import time

import numpy as np
import pytest
from test_serve_server import (
    ENSEMBLE_TYPES,
    RequestFailed,
    expected,
    grpc_ask,
    iterations,
    pipeline,
    png,
)

from qvl_trt.triton import contract as c

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")
__all__ = ["pipeline"]  # the fixture, imported for pytest

LONG_STORY = "Tell me a long story."
STARTED = 10  # tokens (iterations of tensorrt_llm) made before the client cancels
SETTLE_S = 0.5  # the iteration counter unchanged this long: nothing is generating
WAIT_S = 120  # only reached when something is broken


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


def test_the_finish_reason_is_decided_where_the_stop_words_are_known(triton_server,
                                                                     pipeline) -> None:
    """postprocessing (and tensorrt_llm_bls) decide it from the end token, the stop words and
    max_tokens: "length" as the reference decoder says, "stop" for a stop string (left out of
    the text); the final response carries it, on both transports."""
    from qvl_trt.client.generate import GenerateClient, GenerateRequest

    image, question = png(3), "What is in the picture?"
    short = expected(pipeline, question, [image], max_tokens=3)
    full = expected(pipeline, question, [image], max_tokens=12)
    stop = pipeline.preprocessor.prompts.tokenizer.decode([full.token_ids[1]])
    cases = [(GenerateRequest(question, (image,), max_tokens=3), short.finish_reason.value),
             (GenerateRequest(question, (image,), max_tokens=12, stop=(stop,)), "stop")]
    assert [want for _, want in cases] == ["length", "stop"]
    for url in (f"grpc://{triton_server.grpc_url}", f"http://{triton_server.http_url}"):
        for model in (c.ENSEMBLE, c.TENSORRT_LLM_BLS):
            for req, want in cases:
                for stream in (True, False):
                    with GenerateClient(url, model=model) as client:
                        got = client.generate(dataclasses.replace(req, stream=stream))
                    assert got.finish_reason == want, (url, model, stream, req.stop)
                    assert [r.finish_reason for r in got.responses[:-1]] == [""] * (
                        len(got.responses) - 1)
                    if req.stop:
                        assert not got.text.endswith(stop)


@pytest.fixture(scope="module")
def long_story(pipeline) -> int:
    """max_tokens for LONG_STORY, nearly all the room the tiny profile's max_seq_len (1024)
    leaves its prompt. The test allows a cancelled request fewer than half of them, so what
    it needs is that a request not stopped makes at least half: the greedy answer has no end
    token among its first max_tokens // 2 (greedy decoding makes the same first tokens
    whatever max_tokens is, so checking those half costs a quarter of the attention)."""
    from qvl_trt.llm.sampling import FinishReason

    max_tokens = 1000
    assert expected(pipeline, LONG_STORY, max_tokens=max_tokens // 2).finish_reason is \
        FinishReason.LENGTH
    return max_tokens


def settled_iterations(server) -> float:
    """tensorrt_llm's iteration counter once it stops growing (no request is generating),
    polled for at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    last = iterations(server)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = iterations(server)
        if now == last:
            return now
        last = now
    raise AssertionError(f"tokens were still being made after {WAIT_S} s")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "one-response"])
def test_a_cancelled_bls_request_stops_the_generation(triton_server, pipeline, long_story,
                                                      stream: bool) -> None:
    """A client that cancels its request, streamed or not, stops tensorrt_llm: the loop reads
    tensorrt_llm's tokens as a stream either way and asks for the cancel between them (a
    request sent with streaming=false would answer only at max_tokens)."""
    values = {c.TEXT_INPUT: np.array([[LONG_STORY.encode()]], object),
              c.MAX_TOKENS: np.array([[long_story]], np.int32),
              c.TEMPERATURE: np.array([[0.0]], np.float32), c.STREAM: np.array([[stream]])}
    inputs = [infer_input(k, v, ENSEMBLE_TYPES[k]) for k, v in values.items()]
    before = settled_iterations(triton_server)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    try:
        client.async_stream_infer(c.TENSORRT_LLM_BLS, inputs)
        deadline = time.monotonic() + WAIT_S
        while iterations(triton_server) - before < STARTED:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.02)
    finally:
        client.stop_stream(cancel_requests=True)  # the client's cancel
        client.close()
    made = settled_iterations(triton_server) - before
    print(f"cancelled after {STARTED}+ tokens; the reference tensorrt_llm made {made:.0f} "
          f"(of max_tokens {long_story})")
    assert made < long_story // 2, "the generation was not stopped"
    follow = grpc_ask(triton_server, prompt="Still there?", max_tokens=4, stream=stream,
                      model=c.TENSORRT_LLM_BLS)
    assert follow.text == expected(pipeline, "Still there?", max_tokens=4).text
