"""The gateway's request checks and the two things it adds to the ensemble's answer (the stop
string cut off, the finish reason), without a server."""

from __future__ import annotations

import json

import pytest

from qvl_trt.gateway.openai_api import (
    ApiError,
    ChunkWriter,
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
    (body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    (body(tool_choice="auto"), "tool_choice", "not supported"),
    (body(logprobs=True), "logprobs", "not supported"),
    (body(top_logprobs=2), "top_logprobs", "not supported"),
    (body(frequency_penalty=0.5), "frequency_penalty", "not supported"),
    (body(response_format={"type": "json_object"}), "response_format", "not supported"),
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
])
def test_a_bad_field_is_refused_by_name(raw: bytes, param: str | None, words: str) -> None:
    error = refused(raw)
    assert error.status == 400 and words in error.message, error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error",
                                      "param": param, "code": None}}


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
