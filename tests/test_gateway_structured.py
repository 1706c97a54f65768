"""Structured output and tool calls through the gateway over the session's reference
deployment (the tiny RANDOM checkpoint, whose free text is gibberish), with the real `openai`
package as the client: JSON-schema answers that always validate (its response_format and
its pydantic `parse` helper, streamed and not; unguided, the same requests do not), the tool
loop (a forced call, its result, an answer) with the tools and tool messages rendered by
Qwen's chat template exactly, named and required tool choices, and refusals in OpenAI's
shape."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from test_gateway_app import MODEL, client

from qvl_trt.mm.chat import PromptBuilder

openai = pytest.importorskip("openai", reason="the acceptance tests use the openai package as "
                             "the client: pip install openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

# Nested objects, enums, an array and required fields. Strings and arrays are bounded so that
# random sampling completes the structure, and names are one letter: the tiny model may spell
# each forced character as a token of its own, and make test pays for every token.
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 1},
        "b": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 1},
        "c": {"type": "object", "properties": {"d": {"enum": ["x", "y"]}}, "required": ["d"],
              "additionalProperties": False},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                 "strict": True}}
ASK = [{"role": "user", "content": "Describe a thing as JSON."}]
MAX_TOKENS = 64  # the longest answer SCHEMA admits is 39 characters


class C(pydantic.BaseModel):
    d: Literal["x", "y"]


class Thing(pydantic.BaseModel):
    """SCHEMA as the pydantic model `parse` takes (the SDK sends it strict, with $defs)."""

    a: str = pydantic.Field(max_length=1)
    b: list[Literal["p", "q"]] = pydantic.Field(max_length=1)
    c: C


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 4}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def aio(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                              timeout=600)


async def _gather(calls, limit: int = 24) -> list:
    gate = asyncio.Semaphore(limit)

    async def one(call):
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def _streamed_text(api, **request) -> tuple[str, str]:
    stream = await api.chat.completions.create(stream=True, **request)
    text, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


# ---- JSON schema ----------------------------------------------------------------------------

def test_40_json_schema_answers_all_validate_and_unguided_ones_do_not(gateway) -> None:
    """10 requests each way: response_format, response_format streamed, the SDK's `parse`
    with the pydantic model, and its streaming helper with it. Every answer parses and
    validates and ends by itself (the grammar completed; the gateway also checks each before
    it calls it complete: test_gateway_guides.py); unguided, the same requests' answers do
    not validate (the guide does the work)."""
    request = dict(model=MODEL, messages=ASK, max_tokens=MAX_TOKENS)
    thing_schema = Thing.model_json_schema()

    async def run() -> tuple[list, list]:
        async with aio(gateway) as api:
            async def parsed_stream(seed: int):
                async with api.chat.completions.stream(response_format=Thing, seed=seed,
                                                       **request) as stream:
                    return await stream.get_final_completion()

            guided = await _gather(
                [api.chat.completions.create(response_format=FORMAT, seed=i, **request)
                 for i in range(10)]
                + [_streamed_text(api, response_format=FORMAT, seed=i, **request)
                   for i in range(10, 20)]
                + [api.chat.completions.parse(response_format=Thing, seed=i, **request)
                   for i in range(20, 30)]
                + [parsed_stream(i) for i in range(30, 40)])
            free = await _gather([api.chat.completions.create(
                seed=i, **{**request, "max_tokens": 24}) for i in range(4)])
            return guided, free

    guided, free = asyncio.run(run())
    for i, answer in enumerate(guided):
        if isinstance(answer, tuple):  # streamed text
            text, finish = answer
        else:
            text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), thing_schema if i >= 20 else SCHEMA)
        if i >= 20:  # the SDK's own parse of the answer into the model
            assert isinstance(answer.choices[0].message.parsed, Thing)
    assert len({json.dumps(json.loads(a[0] if isinstance(a, tuple) else
                                      a.choices[0].message.content)) for a in guided}) > 5
    for answer in free:
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_json_object_guides_the_answer_to_an_object(gateway) -> None:
    """Any object, laid out without free blanks; the tiny model's strings are unbounded, so
    the answer may stop at max_tokens: it is then the start of an object."""
    answer = client(gateway).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, seed=1,
        response_format={"type": "json_object"})
    text = answer.choices[0].message.content
    assert text.startswith("{") and "\n" not in text, text
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


# ---- tools ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tiny_ckpt) -> PromptBuilder:
    from qvl_trt.checkpoint import open_checkpoint

    ckpt = open_checkpoint(tiny_ckpt)
    return PromptBuilder.from_checkpoint(ckpt.path, ckpt.token_ids)


def prompt_tokens(prompts: PromptBuilder, messages: list, tools: list | None) -> int:
    """The prompt's length as Qwen's template renders it (the checkpoint's own template)."""
    text, *_ = prompts.render(messages, tools)
    return len(prompts.tokenizer(text)["input_ids"])


def _arguments(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_the_tool_loop_of_the_openai_client(gateway, prompts) -> None:
    """A forced call, the tool's result sent back as a tool message, then an answer: each
    prompt is exactly Qwen's template's rendering of the tools and the turns (the call as a
    <tool_call> block, the result as a <tool_response>)."""
    api = client(gateway)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=MAX_TOKENS, seed=3)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        _arguments(call)
    assert first.usage.prompt_tokens == prompt_tokens(prompts, messages, TOOLS)

    messages.append(choice.message.model_dump(exclude_none=True))  # as the SDK's users do
    messages += [{"role": "tool", "tool_call_id": c.id, "content": f"sunny, {i + 20} C"}
                 for i, c in enumerate(calls)]
    second = api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                         max_tokens=8, seed=3)
    assert second.usage.prompt_tokens == prompt_tokens(prompts, messages, TOOLS)
    text, *_ = prompts.render(messages, TOOLS)
    # The template's tools section names the tag twice, then come the calls.
    assert text.count("<tool_call>") == 2 + len(calls)
    assert text.count("<tool_response>") == len(calls)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: the template still lists the tools; the answer is text.
    none = api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, seed=3)
    assert none.usage.prompt_tokens == second.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    plain = api.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1)
    assert plain.usage.prompt_tokens == prompt_tokens(prompts, messages[:1], None) < \
        first.usage.prompt_tokens


def test_required_and_named_tool_choices_always_call_with_valid_arguments(gateway) -> None:
    """tool_choice required: 12 answers, streamed and not, each one or more calls whose
    arguments validate against their function's parameters (exactly one without parallel
    calls); a named function: that function, its arguments streamed in pieces."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather? Time?"}],
                   tools=TOOLS, max_tokens=4 * MAX_TOKENS)

    async def streamed_calls(api, **more) -> tuple[dict, str, int]:
        stream = await api.chat.completions.create(stream=True, **request, **more)
        calls, finish, pieces = {}, None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                assert not choice.delta.content
                for delta in choice.delta.tool_calls or ():
                    call = calls.setdefault(delta.index, {"arguments": ""})
                    if delta.id:
                        call |= {"id": delta.id, "name": delta.function.name}
                    call["arguments"] += delta.function.arguments or ""
                    pieces += 1
                finish = choice.finish_reason or finish
        return calls, finish, pieces

    async def run():
        async with aio(gateway) as api:
            named = {"type": "function", "function": {"name": "time"}}
            one = dict(tool_choice="required", parallel_tool_calls=False)
            return await _gather(
                [api.chat.completions.create(tool_choice="required", seed=0, **request),
                 streamed_calls(api, tool_choice="required", seed=1)]
                + [api.chat.completions.create(seed=i, **one, **request) for i in range(2, 7)]
                + [streamed_calls(api, seed=i, **one) for i in range(7, 12)]
                + [api.chat.completions.create(tool_choice=named, seed=i, **request)
                   for i in range(12, 14)]
                + [streamed_calls(api, tool_choice=named, seed=i) for i in range(14, 16)])

    answers = asyncio.run(run())
    for i, answer in enumerate(answers):
        if isinstance(answer, tuple):
            calls, finish, pieces = answer
            assert finish == "tool_calls" and calls, answer
            assert sorted(calls) == list(range(len(calls)))
            for call in calls.values():
                assert call["id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
            names = [c["name"] for c in calls.values()]
            if i >= 14:
                assert pieces > 2  # the named function's arguments come as they are made
        else:
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            names = [c.function.name for c in choice.message.tool_calls]
            for call in choice.message.tool_calls:
                _arguments(call)
        if 2 <= i < 12:
            assert len(names) == 1  # without parallel calls
        if i >= 12:
            assert names == ["time"]


def test_the_sdks_strict_pydantic_tool_is_parsed(gateway) -> None:
    """openai.pydantic_function_tool (strict, with $defs) and `parse`: the call's arguments
    come back as the model."""
    answer = client(gateway).chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Thing)],
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, seed=7)
    calls = answer.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Thing) for c in calls)


# ---- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type",
     "is not supported: this server calls function tools only"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "required"},
     "tools[0].type", "function tools only"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    # Checked in the gateway: a bad schema never reaches the executor's step.
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}},
     "response_format.json_schema.schema", "properties must be an object of schemas"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"oneOf": []}}}}}},
     "response_format.json_schema.schema", "properties.a.oneOf uses 'oneOf'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "is not among tools (weather, time)"),
    ({"response_format": {"type": "grammar", "grammar": "root ::= \"a\""}}, "response_format",
     "is not supported"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_stays_unsupported_is_refused_in_openais_shape(gateway, fields, param, words,
                                                            stream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                stream=stream, **fields)
    body = caught.value.body
    assert caught.value.status_code == 400 and words in body["message"], body
    assert body["param"] == param and body["type"] == "invalid_request_error"
