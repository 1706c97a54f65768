"""Reading tool calls out of the generated text, without a server: Qwen's <tool_call> blocks
(several, streamed in any pieces, malformed ones left as text), the guided call list of
tool_choice required and the guided arguments of a named function, in OpenAI's message and
chunk shapes."""

from __future__ import annotations

import json

import pytest

from qvl_trt.gateway.openai_api import Answer, Structure
from qvl_trt.gateway.tool_calls import (
    CallList,
    Delta,
    NamedCall,
    TaggedCalls,
    finish_reason,
    message,
    reader,
)


def block(name: str, arguments: dict) -> str:
    """A call as Qwen writes it (its chat template's own spelling)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


TWO_CALLS = ("Let me look.\n" + block("get_weather", {"city": "Paris", "days": [1, 2]}) + "\n"
             + block("get_time", {"zone": "CET"}))


def read(answer, pieces) -> list[Delta]:
    deltas = [d for piece in pieces for d in answer.feed(piece)]
    return deltas + answer.close()


def calls_of(deltas: list[Delta]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message(deltas).get("tool_calls", [])]


def test_several_calls_are_read_with_the_text_before_them() -> None:
    msg = message(read(TaggedCalls(), [TWO_CALLS]))
    assert msg["content"] == "Let me look."
    assert calls_of(read(TaggedCalls(), [TWO_CALLS])) == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"zone": "CET"})]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert {c["type"] for c in msg["tool_calls"]} == {"function"}


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 64])
def test_streamed_in_any_pieces_the_calls_and_text_are_the_same(size: int) -> None:
    pieces = [TWO_CALLS[i:i + size] for i in range(0, len(TWO_CALLS), size)]
    deltas = read(TaggedCalls(), pieces)
    whole = read(TaggedCalls(), [TWO_CALLS])
    assert message(deltas)["content"] == message(whole)["content"] == "Let me look."
    assert calls_of(deltas) == calls_of(whole)
    # No piece of a tag ever reaches the content, and each call starts with its id and name.
    assert not any("<" in d.text for d in deltas if d.index is None)
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "get_time")]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}\n</tool_call>",  # JSON cut short
    "<tool_call>\n[1, 2]\n</tool_call>",  # not an object
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"x=1\"}\n</tool_call>",  # not an object
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}, \"id\": 3}\n</tool_call>",  # extra key
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}",  # never closed (max_tokens)
    "a <tool_c and < and <tool_call but no call",
])
def test_malformed_calls_stay_content_as_written(text: str) -> None:
    for pieces in ([text], list(text)):
        deltas = read(TaggedCalls(), pieces)
        assert message(deltas) == {"role": "assistant", "content": text}


def test_a_malformed_block_among_good_ones_stays_in_the_content() -> None:
    bad = "<tool_call>\n{oops}\n</tool_call>"
    deltas = read(TaggedCalls(), list(block("f", {}) + "\n" + bad))
    assert calls_of(deltas) == [("f", {})]
    assert message(deltas)["content"] == bad


def test_text_without_calls_passes_unchanged_also_its_blanks() -> None:
    text = "  Hello  \n\n world <b> x \n"
    assert message(read(TaggedCalls(), list(text)))["content"] == text
    assert message(read(reader(Structure()), [text]))["content"] == text


def test_without_parallel_calls_the_first_call_is_kept() -> None:
    deltas = read(TaggedCalls(parallel=False), [TWO_CALLS])
    assert calls_of(deltas) == [("get_weather", {"city": "Paris", "days": [1, 2]})]


def test_a_call_without_arguments_has_empty_ones() -> None:
    deltas = read(TaggedCalls(), ['<tool_call>\n{"name": "now"}\n</tool_call>'])
    assert calls_of(deltas) == [("now", {})] and message(deltas)["content"] is None


def test_the_guided_call_list_of_tool_choice_required() -> None:
    text = json.dumps([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])
    answer = CallList()
    deltas = read(answer, [text[:5], text[5:]])
    assert calls_of(deltas) == [("f", {"a": 1}), ("g", {})] and answer.calls == 2
    assert message(deltas)["content"] is None
    cut = text[:-9]  # max_tokens reached: not a list of calls, so content
    assert message(read(CallList(), [cut])) == {"role": "assistant", "content": cut}


def test_a_named_function_streams_its_guided_arguments_as_they_come() -> None:
    answer = NamedCall("get_weather")
    deltas = read(answer, ['{"ci', 'ty": ', '"Paris"}'])
    assert [d.chunk() for d in deltas[:2]] == [
        {"tool_calls": [{"index": 0, "id": deltas[0].id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert calls_of(deltas) == [("get_weather", {"city": "Paris"})]
    empty = message(read(NamedCall("f"), []))["tool_calls"]  # nothing generated: the call
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in empty] == [("f", "")]


def test_readers_follow_the_requests_structure_and_the_finish_reason_the_calls() -> None:
    assert isinstance(reader(Structure(answer=Answer.TAGGED_CALLS)), TaggedCalls)
    assert isinstance(reader(Structure(answer=Answer.CALL_LIST)), CallList)
    assert reader(Structure(answer=Answer.NAMED_CALL, function="f")).name == "f"
    assert finish_reason("stop", 2) == "tool_calls"
    assert finish_reason("stop", 0) == "stop"
    assert finish_reason("length", 1) == "length"  # cut short: OpenAI says length
    assert Delta("hi").chunk() == {"content": "hi"}
