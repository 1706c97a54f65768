"""The gateway's request checks and the two things it adds to the ensemble's answer (the stop
string cut off, the finish reason), without a server."""

from __future__ import annotations

import json

import pytest

from qvl_trt.gateway.openai_api import (
    ApiError,
    ChunkWriter,
    model_card,
    parse_chat_request,
)

MESSAGES = [{"role": "user", "content": "Hi"}]


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(raw)
    return caught.value


def test_a_full_request_is_read_field_by_field() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
             {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
             {"type": "text", "text": "What is here?"}]
    req = parse_chat_request(body(
        messages=[{"role": "user", "content": parts}], max_completion_tokens=7, temperature=0,
        top_p=0.5, top_k=-1, seed=2**64 - 1, stop="END", stream=True,
        stream_options={"include_usage": True}, user="u1", n=1, logprobs=False,
        presence_penalty=0, response_format={"type": "text"}, tools=None))
    assert req.messages[0]["content"] == parts  # forwarded as sent, video part included
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == \
        (7, 0.0, 0.5, 0, 2**64 - 1)
    assert req.stop == ("END",) and req.stream and req.include_usage
    defaults = parse_chat_request(body())
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.top_k,
            defaults.seed, defaults.stop, defaults.stream) == (None,) * 5 + ((), False)


@pytest.mark.parametrize("raw, param, words", [
    (b"{oops", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b'{"model": "m", "messages": [], "temperature": NaN}', None, "not valid JSON"),
    (body(n=2), "n", "n = 2 is not supported"),
    (body(n=True), "n", "not supported"),  # true is not 1
    (body(logprobs=True), "logprobs", "not supported"),
    (body(top_logprobs=2), "top_logprobs", "not supported"),
    (body(frequency_penalty=0.5), "frequency_penalty", "not supported"),
    (body(audio={"voice": "x"}), "audio", "leave it out"),
    (body(best_of=2), "best_of", "unsupported parameter 'best_of'"),
    (body(max_tokens=0), "max_tokens", "from 1 to"),
    (body(max_completion_tokens=2**31), "max_completion_tokens", "from 1 to"),
    (body(max_tokens=5, max_completion_tokens=6), "max_tokens", "differ"),
    (body(max_tokens=5.0), "max_tokens", "must be an integer"),
    (body(temperature="hot"), "temperature", "must be a number"),
    (body(temperature=True), "temperature", "must be a number"),
    (body(seed=-1), "seed", "from 0 to"),
    (body(stop=["a", 3]), "stop", "string or a list of strings"),
    (body(stream="yes"), "stream", "true or false"),
    (body(stream_options={"include_usage": True}), "stream_options", "only allowed when"),
    (body(stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats", "needs include_usage true"),
    (body(stream=True, stream_options={"include_usage": True, "every_chunk": True}),
     "stream_options", "only include_usage and continuous_usage_stats"),
    (json.dumps({"messages": MESSAGES}).encode(), "model", "model is required"),
    (json.dumps({"model": "m", "messages": []}).encode(), "messages", "non-empty list"),
    (json.dumps({"model": "m", "messages": "Hi"}).encode(), "messages", "non-empty list"),
    # JSON can spell a lone surrogate, which UTF-8 (the ensemble's text) cannot carry.
    (body(messages=[{"role": "user", "content": "a\ud800"}]), "messages[0].content",
     "messages[0].content holds a lone surrogate (U+D800 at character 1)"),
    (body(messages=[MESSAGES[0], {"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]), "messages[1].content[0].text",
     "messages[1].content[0].text holds a lone surrogate"),
    (body(messages=[{"role": "user", "content": "Hi", "\ud801": 1}]), "messages[0]",
     "a key of messages[0] holds a lone surrogate"),
    (body(stop="\udc80"), "stop", "stop holds a lone surrogate (U+DC80"),
    (body(stop=["ok", "x\ud800"]), "stop", "stop[1] holds a lone surrogate"),
    # Nested past the JSON parser's bound: a RecursionError, answered as a bad body.
    (b"[" * 100_000 + b"]" * 100_000, None, "nests its JSON too deeply"),
    (b'{"model": "m", "messages": ' + b"[" * 100_000, None, "nests its JSON too deeply"),
    # FP32 inputs: a number beyond float32 would travel as inf.
    (body(temperature=1e308), "temperature", "temperature = 1e+308 is beyond float32"),
    (body(top_p=10**400), "top_p", "is beyond float32"),
    (body(min_tokens=-1), "min_tokens", "from 0 to"),
    (body(min_tokens=5, max_tokens=4), "min_tokens", "min_tokens = 5 is above max_tokens = 4"),
    (body(ignore_eos=1), "ignore_eos", "true or false"),
])
def test_a_bad_field_is_refused_by_name(raw: bytes, param: str | None, words: str) -> None:
    error = refused(raw)
    assert error.status == 400 and words in error.message, error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error",
                                      "param": param, "code": None}}


def test_vllms_fixed_length_fields_and_tiny_temperatures_are_read() -> None:
    req = parse_chat_request(body(max_tokens=8, min_tokens=8, ignore_eos=True, stream=True,
                                  stream_options={"include_usage": True,
                                                  "continuous_usage_stats": True}))
    assert (req.min_tokens, req.ignore_eos, req.include_usage, req.continuous_usage) == \
        (8, True, True, True)
    plain = parse_chat_request(body())
    assert (plain.min_tokens, plain.ignore_eos, plain.continuous_usage) == (None, False, False)
    # Below float32's normal range: taken (the deployment computes them as TensorRT-LLM does).
    assert parse_chat_request(body(temperature=1e-45)).temperature == 1e-45
    # Paired surrogates are ordinary text.
    assert parse_chat_request(body(stop="\ud83d\ude00")).stop == ("😀",)


def test_a_model_card_names_its_checkpoint_as_root() -> None:
    assert model_card("ensemble", 7, "Qwen3-VL-2B-Instruct") == {
        "id": "ensemble", "object": "model", "created": 7, "owned_by": "qvl-trt",
        "root": "Qwen3-VL-2B-Instruct", "parent": None}


def test_stream_chunks_carry_a_null_usage_only_when_usage_was_asked_for() -> None:
    def decode(event: bytes) -> dict:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        return json.loads(event[6:])

    plain = decode(ChunkWriter("m", include_usage=False).event({"content": "é"}))
    assert "usage" not in plain and plain["choices"][0]["delta"] == {"content": "é"}
    writer = ChunkWriter("m", include_usage=True)
    chunk = decode(writer.event({}, "stop"))
    assert chunk["usage"] is None and chunk["choices"][0]["finish_reason"] == "stop"
    last = decode(writer.usage_event({"prompt_tokens": 1}))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 1}
    assert last["id"] == chunk["id"] and last["object"] == "chat.completion.chunk"
    # continuous_usage_stats: every chunk carries the usage so far.
    counts = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    continuous = ChunkWriter("m", include_usage=True, continuous_usage=True)
    assert decode(continuous.event({"content": "a"}, counts=counts))["usage"] == counts
    assert decode(writer.event({"content": "a"}, counts=counts))["usage"] is None
