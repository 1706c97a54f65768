"""The gateway's request checks and the two things it adds to the ensemble's answer (the stop
string cut off, the finish reason), without a server."""

from __future__ import annotations

import json
import re

import pytest

from qvl_trt.gateway.openai_api import (
    ANY_OBJECT,
    MAX_JSON_SEPARATORS,
    Answer,
    ApiError,
    ChunkWriter,
    Structure,
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
        presence_penalty=0, response_format={"type": "text"}, tools=None,
        tool_choice="none"))
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
    assert model_card("ensemble", 7, "Qwen3-VL-2B-Instruct", 4096, {"max_images": 2},
                      ["ensemble"]) == {
        "id": "ensemble", "object": "model", "created": 7, "owned_by": "qvl-trt",
        "root": "Qwen3-VL-2B-Instruct", "parent": None, "max_model_len": 4096,
        "limits": {"max_images": 2}, "builds": ["ensemble"]}


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


# ---- structured output: response_format, tools, tool_choice ---------------------------------

TOOL = {"type": "function", "function": {
    "name": "weather", "description": "d", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "time"}}  # no parameters: none taken


def structure(**fields) -> Structure:
    return parse_chat_request(body(**fields)).structure


def test_response_formats_become_the_schema_the_answer_is_guided_to() -> None:
    assert structure() == structure(response_format={"type": "text"}) == Structure()
    obj = structure(response_format={"type": "json_object"})
    assert json.loads(obj.schema) == ANY_OBJECT and obj.answer is Answer.TEXT
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}}
    for strict in (True, False, None):  # enforced either way
        got = structure(response_format={"type": "json_schema", "json_schema": {
            "name": "a-b_1", "schema": schema, "strict": strict, "description": "x"}})
        assert json.loads(got.schema) == schema
        assert got.schema_param == "response_format.json_schema.schema"
    # With tool_choice auto the format wins: a guided JSON answer calls no tool.
    both = structure(response_format={"type": "json_object"}, tools=[TOOL])
    assert both.answer is Answer.TEXT and both.tools == [TOOL]


def test_tool_choices_become_the_templates_tools_a_guide_and_an_answer_reader() -> None:
    auto = structure(tools=[TOOL, CLOCK])
    assert (auto.tools, auto.schema, auto.answer) == ([TOOL, CLOCK], None, Answer.TAGGED_CALLS)
    assert structure(tools=[TOOL], tool_choice="auto") == Structure(
        [TOOL], answer=Answer.TAGGED_CALLS)
    # none: the template still lists the tools (OpenAI's semantics); nothing is parsed.
    none = structure(tools=[TOOL], tool_choice="none")
    assert (none.tools, none.schema, none.answer) == ([TOOL], None, Answer.TEXT)
    assert structure(tools=[], tool_choice="none") == structure(tool_choice="none") == \
        Structure()
    named = structure(tools=[TOOL, CLOCK], tool_choice={"type": "function",
                                                        "function": {"name": "time"}})
    assert (named.answer, named.function, named.schema_param) == \
        (Answer.NAMED_CALL, "time", "tools[1].function.parameters")
    assert json.loads(named.schema) == {"type": "object", "properties": {}}
    assert not structure(tools=[TOOL], parallel_tool_calls=False).parallel_tool_calls


def test_tool_choice_required_guides_to_a_list_of_calls_of_the_tools() -> None:
    """vLLM's schema for it: one or more {name, parameters}, each of one function; one
    at most without parallel calls; $defs moved to the root where references point."""
    defs_tool = {"type": "function", "function": {"name": "pet", "parameters": {
        "$defs": {"Kind": {"enum": ["cat", "dog"]}},
        "type": "object", "properties": {"kind": {"$ref": "#/$defs/Kind"}},
        "required": ["kind"]}}}
    got = structure(tools=[TOOL, CLOCK, defs_tool], tool_choice="required")
    assert (got.answer, got.schema_param) == (Answer.CALL_LIST, "tools")
    schema = json.loads(got.schema)
    jsonschema = pytest.importorskip("jsonschema")
    good = [{"name": "weather", "parameters": {"city": "Paris"}},
            {"name": "time", "parameters": {}}, {"name": "pet", "parameters": {"kind": "cat"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "weather", "parameters": {}}],  # city is required
                [{"name": "nope", "parameters": {}}],
                [{"name": "pet", "parameters": {"kind": "owl"}}],  # through the $ref
                [{"name": "time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert defs_tool["function"]["parameters"]["$defs"]  # the request's own tools untouched
    one = json.loads(structure(tools=[TOOL], tool_choice="required",
                               parallel_tool_calls=False).schema)
    jsonschema.validate(good[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:1] * 2, one)


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "function tools only"),
    ({"tools": [TOOL, {"type": "custom", "custom": {"name": "x"}}]}, "tools[1].type",
     "function tools only"),
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be {type: function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "1 to 64 letters"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name", "names a second function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "must be a JSON schema of type object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     "tools[0].function.returns", "is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict", "true or false"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are specified"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "only allowed when tools are specified"),
    ({"tools": [TOOL], "tool_choice": "any"}, "tool_choice", "is not supported"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
     "tool_choice", "is not supported"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "time"}}},
     "tool_choice", "'time', which is not among tools (weather)"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "send one of them"),
    ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "leave ignore_eos out"),
    ({"tools": [TOOL], "tool_choice": "required", "min_tokens": 4}, "min_tokens",
     "leave min_tokens out"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format",
     "is not supported"),
    ({"response_format": {"type": "regex", "regex": "a+"}}, "response_format",
     "is not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "needs \"json_schema\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be a JSON schema object, got null"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": "{}"}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "strict": 1}}},
     "response_format.json_schema.strict", "true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "format": "y"}}},
     "response_format.json_schema.format", "is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": "\ud800"}}]},
     "tools[0].function.description", "lone surrogate"),
])
def test_what_structured_output_cannot_take_is_refused_by_name(fields, param, words) -> None:
    error = refused(body(**fields))
    assert error.status == 400 and words in error.message, error.message
    assert error.param == param


def _named(parameters: object) -> dict:
    """A request forcing a call of one function with these parameters."""
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


def _required(parameters: object) -> dict:
    return {**_named(parameters), "tool_choice": "required"}


def _formatted(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}


OBJECT = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}
PARAMS = "tools[0].function.parameters"
FORMAT = "response_format.json_schema.schema"


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields, param, words", [
    # Shapes that crashed the gateway or preprocessing: $defs of every non-object kind.
    *[(_required({**OBJECT, "$defs": bad}), PARAMS, "$defs must be an object of schemas")
      for bad in ("s", None, [], 3)],
    (_required({**OBJECT, "properties": {"k": 5}}), PARAMS, "properties.k is 5, not a schema"),
    (_named({**OBJECT, "properties": []}), PARAMS, "properties must be an object of schemas"),
    # Nesting: one documented number for the body, another for a guided schema.
    (_named(_nested(40)), "tools", "more than 64 levels deep"),
    (_formatted(_nested(11)), FORMAT, "nests schemas 11 deep, above the 10"),
    # Keywords the converter would drop: refused, naming keyword and place.
    *[(_formatted({**OBJECT, key: value}), FORMAT, f"uses {key!r}, which is not supported")
      for key, value in (("if", {}), ("then", {}), ("else", {}), ("oneOf", [OBJECT]),
                         ("not", {}), ("dependentRequired", {}),
                         ("patternProperties", {}), ("unevaluatedProperties", False))],
    (_formatted({"type": "array", "items": {"type": "integer", "multipleOf": 3}}), FORMAT,
     "items.multipleOf uses 'multipleOf'"),
    (_formatted({"type": "array", "uniqueItems": True}), FORMAT, "uses 'uniqueItems'"),
    (_formatted({"type": "array", "contains": {"type": "integer"}}), FORMAT,
     "uses 'contains'"),
    (_formatted({"type": "string", "format": "color"}), FORMAT, "xgrammar does not guide"),
    (_formatted({"type": "string", "format": "email", "pattern": "a"}), FORMAT,
     "stands beside pattern"),
    (_formatted({"allOf": [OBJECT, OBJECT]}), FORMAT, "must hold one schema"),
    (_formatted({**OBJECT, "allOf": [OBJECT]}), FORMAT, "stands beside 'allOf'"),
    (_formatted({"type": "string", "anyOf": [{"type": "string"}]}), FORMAT,
     "stands beside 'anyOf'"),
    (_formatted({"$ref": "#/$defs/a", "$defs": {"a": OBJECT}, "required": []}), FORMAT,
     "required stands beside '$ref'"),
    (_formatted({"properties": {"k": {"maxLength": 3}}}), FORMAT,
     'properties.k.maxLength needs "type": "string"'),
    (_formatted({**OBJECT, "additionalProperties": True}), FORMAT,
     "additionalProperties beside properties must be false"),
    (_formatted({**OBJECT, "required": ["k", "gone"]}), FORMAT,
     "required names 'gone', which is not among its properties"),
    (_formatted({"$ref": "https://example.com/s.json"}), FORMAT,
     "only plain references within the schema"),
    (_formatted({"$ref": "#/$defs/missing"}), FORMAT, "points at nothing"),
    (_formatted({"type": "number", "minimum": 0.5, "maximum": 0.6}), FORMAT,
     "minimum uses 'minimum', which is not supported: xgrammar 0.1.32 builds wrong grammars"),
    (_formatted({"type": "object", "properties": {"a\\b": {"type": "string"}}}), FORMAT,
     "quote, backslash or control character"),
    (_formatted({"type": "strings"}), FORMAT, "type is \"strings\""),
    # Bounds that would make the guide cost every request of the step.
    (_formatted({"type": "string", "maxLength": 5}), FORMAT, "maxLength is 5, above the 4"),
    (_formatted({"type": "string", "pattern": "^[^x]{0,400}$"}), FORMAT, "repeats {0,400}"),
    (_formatted({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                   for i in range(201)}}), FORMAT,
     "201 properties, above the 200"),
    (_formatted({"enum": list(range(1001))}), FORMAT, "1001 enum values, above the 1000"),
    (_formatted({"enum": ["x" * 70000]}), FORMAT, "above the 65536"),
    # OpenAI's semantics.
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are specified"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                   "parameters": {"type": "array"}}}]},
     PARAMS, "must be a JSON schema of type object"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "leave stop out"),
    ({"tools": [TOOL], "tool_choice": "required", "stop": "x"}, "stop", "leave stop out"),
])
def test_hostile_schemas_and_shapes_are_400s_naming_the_place(fields, param, words) -> None:
    error = refused(body(**fields))
    assert error.status == 400 and words in error.message, error.message
    assert error.param == param


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                       "arguments": '{"city": "P"}'}}]}


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "tool", "content": "r"}], "messages[1].tool_call_id", "is missing"),
    ([{"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages[1].tool_call_id", "'call_9' answers no tool call"),
    ([{**ASSISTANT_CALL, "tool_calls": [{"type": "function", "function": {
        "name": "weather", "arguments": "{}"}}]}], "messages[1].tool_calls[0].id", "is missing"),
    ([{**ASSISTANT_CALL, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "weather", "arguments": {"city": "P"}}}]}],
     "messages[1].tool_calls[0].function.arguments", "must be a string of JSON"),
    # An answer to a call made later does not count.
    ([{"role": "tool", "tool_call_id": "call_1", "content": "r"}, ASSISTANT_CALL],
     "messages[1].tool_call_id", "answers no tool call"),
])
def test_a_tool_exchange_follows_openais_rules(messages, param, words) -> None:
    error = refused(body(messages=[{"role": "user", "content": "Hi"}, *messages]))
    assert error.status == 400 and words in error.message, error.message
    assert error.param == param


def test_a_tool_exchange_that_follows_them_is_taken() -> None:
    req = parse_chat_request(body(tools=[TOOL], messages=[
        {"role": "user", "content": "Hi"}, ASSISTANT_CALL,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]))
    assert len(req.messages) == 3


def test_top_p_0_is_the_smallest_nucleus_the_most_likely_token() -> None:
    req = parse_chat_request(body(top_p=0, top_k=40))
    assert (req.top_p, req.top_k) == (None, 1)
    assert parse_chat_request(body(top_p=0.5)).top_p == 0.5


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [' + \
        b",".join([b"1"] * 300_000) + b"]}]}"
    error = refused(raw)
    assert error.status == 413 and error.code == "request_too_large"
    assert f"{raw.count(b',') + raw.count(b'[') + raw.count(b'{')} JSON separators" in \
        error.message


def test_the_documented_subset_is_the_one_the_code_checks() -> None:
    """docs/openai.md's table of schema keywords and its bounds, against schema_subset.py."""
    from pathlib import Path

    from qvl_trt.llm import schema_subset as ss
    from qvl_trt.triton import contract

    text = (Path(__file__).resolve().parents[1] / "docs" / "openai.md").read_text()
    table = text.split("<!-- schema subset table")[1].split("\n\n")[0]
    taken, refused = set(), set()
    for row in table.splitlines()[3:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        keys = set(re.findall(r"`([^`]+)`", cells[0]))
        (refused if cells[1] == "no" else taken).update(keys)
    assert taken == ss.SUPPORTED and refused == set(ss.REFUSED)
    assert ", ".join(ss.FORMATS) in table
    assert f"`{{m,n}}` up to {ss.MAX_STRING_BOUND}" in table
    prose = " ".join(text.split())
    for words in (f"{ss.MAX_NESTING} levels of schemas", f"{ss.MAX_PROPERTIES} properties",
                  f"{ss.MAX_ENUM_VALUES} enum values", f"{ss.MAX_SCHEMA_BYTES // 1024} KiB",
                  f"at most {contract.MAX_JSON_DEPTH} levels deep",
                  f"at most {MAX_JSON_SEPARATORS} separators"):
        assert words in prose, words
