"""The OpenAI chat-completions API as the gateway speaks it: the request body checked at the edge
(`parse_chat_request`), the error object (`ApiError`), and the response and stream-chunk
objects. The answer's text comes without its stop string and with its finish reason from the
deployment (postprocessing decides both, where the stop words are known).

Pure functions over JSON-shaped values: no web server, no Triton.

The body's fields, their JSON types and ranges are declared once (`FIELDS`); the rules the
deployment owns (the settings' ranges, min_tokens against max_tokens, how a guided answer
ends) are its own functions, called here so that the gateway refuses at the edge in the
deployment's words. What is refused rather than ignored: every field the deployment cannot
honour (n > 1, logprobs, penalties, ...) unless it carries the value that asks for the
default behaviour (n = 1, logprobs false, penalties 0, ...), and any field this API does not
know. `messages`
travels to the ensemble as sent (its `messages` input): preprocessing checks the roles and
content parts, resolves `image_url` and `video_url` data URIs and allow-listed hosts, and
refuses other part types with a one-line reason.

Structured output (`Structure`): `response_format` json_object / json_schema and
`tool_choice` required / a named function become a guide for the deployment's guided
decoding (the stock backend's guide types, compiled by xgrammar); function `tools` travel to
the chat template (the ensemble's `tools` input), and the answer's text becomes tool calls
(tool_calls.py reads it).
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..chat_messages import MESSAGES_SHAPE, MM_PROCESSOR_KWARGS, check_budgets, check_tool_turns
from ..errors import FieldError, InputError, QvlError
from ..llm.schema_subset import SchemaError, check_schema
from ..triton import contract as c

# The most separators (`,` `[` `{`, counted in the raw bytes, strings included) a body may
# hold: parsed, each costs a Python object; counting them is cheap, parsing is not, and the
# parser holds the event loop. Text and images need far fewer (a data URI has one).
MAX_JSON_SEPARATORS = 250_000


class ApiError(QvlError):
    """An answer with an HTTP error status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # a 429's or 503's Retry-After (None: 1 s)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class Answer(enum.Enum):
    """How the generated text becomes the message: its content as it is, tool calls in Qwen's
    `<tool_call>` tags among the content (tool_choice auto), a guided JSON list of calls
    (required), or the guided arguments of the one named function."""

    TEXT = "text"
    TAGGED_CALLS = "tagged_calls"
    CALL_LIST = "call_list"
    NAMED_CALL = "named_call"


@dataclass(frozen=True)
class Structure:
    """What response_format, tools and tool_choice ask for: the tools for the template, the
    JSON schema the answer is guided to (guides.py makes the guide) and how the answer reads."""

    tools: list[dict[str, Any]] | None = None  # for the template: as sent, checked
    schema: str | None = None  # JSON text of the schema, None: unguided
    schema_param: str | None = None  # the request's field that gave the schema
    answer: Answer = Answer.TEXT
    function: str | None = None  # the named function of NAMED_CALL
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A checked chat-completions body: what the ensemble's inputs are made of."""

    model: str
    messages: list[Any]  # as sent; preprocessing checks roles and content parts
    max_tokens: int | None = None  # None: the deployment's default
    temperature: float | None = None  # None: the checkpoint's generation default
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; vLLM's extension, -1 or 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far.
    continuous_usage: bool = False
    # vLLM's: no end token before min_tokens tokens; ignore_eos: none ends the answer.
    min_tokens: int | None = None
    ignore_eos: bool = False
    structure: Structure = Structure()  # response_format, tools, tool_choice
    # This server's: false keeps the request out of the answer cache (answer_cache.py).
    answer_cache: bool = True
    # vLLM's: the visual budget of every image and video part that gives none of its own
    # (chat_messages.check_mm_processor_kwargs); travels with the messages.
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class Field:
    """One field of the body as it is checked before any reader sees it: the JSON type it
    takes (None: any; its reader checks it), an integer's range, the refusal's words for a
    required field that is absent, empty or of another type, and an object's own fields. A
    field the deployment cannot honour lists the values that ask for nothing more than what
    it does anyway (`only`; () for none)."""

    type: type | tuple[type, ...] | None = None
    low: int | None = None
    high: int | None = None
    required: str | None = None
    fields: Mapping[str, Field] | None = None
    only: tuple[Any, ...] | None = None

    def check(self, value: Any, param: str) -> Any:
        """`value` (not null) checked, or ApiError 400 naming `param`; an object as its
        fields' checked values."""
        if self.only is not None:
            if _canonical(value) not in {_canonical(a) for a in self.only}:
                fix = f"leave it out or send {json.dumps(self.only[0])}" if self.only \
                    else "leave it out"
                raise bad_request(f"{param} = {json.dumps(value)[:60]} is not supported by "
                                  f"this server; {fix}", param)
            return value
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        # bool is an int in Python; a JSON true is no number here.
        if self.type is not None and (not isinstance(value, types) or (
                isinstance(value, bool) and bool not in types)):
            if self.required:
                raise bad_request(self.required, param)
            raise bad_request(f"{param} must be {self._what()}, got {json.dumps(value)[:40]}",
                              param)
        if self.required and not value:
            raise bad_request(self.required, param)
        if self.low is not None:
            with _as_param():
                c.check_range(param, value, self.low, self.high)
        return value if self.fields is None else _checked(value, self.fields, param)

    def _what(self) -> str:
        if self.low is not None:
            return f"an integer from {self.low} to {self.high}"
        return {bool: "true or false", str: "a string", dict: "an object", list: "a list",
                (int, float): "a number"}[self.type]


def _setting(name: str) -> Field:
    """An integer the ensemble takes as its input `name`, in the range the deployment takes."""
    return Field(int, *c.SETTING_RANGES[name])


_BOOL, _NUMBER, _ANY = Field(bool), Field((int, float)), Field()

# The body's fields, each once: a field not here is refused by name. Those of type None are
# checked by their readers below (structured output, stop).
FIELDS: Mapping[str, Field] = {
    "model": Field(str, required="model is required: the name of a served model "
                   "(GET /v1/models)"),
    # As sent; preprocessing checks roles and content parts.
    "messages": Field(list, required=MESSAGES_SHAPE),
    "max_tokens": _setting(c.MAX_TOKENS),
    "max_completion_tokens": _setting(c.MAX_TOKENS),
    "min_tokens": _setting(c.MIN_TOKENS),  # vLLM's
    "ignore_eos": _BOOL,  # vLLM's
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": Field(int, -1, c.INT32_MAX),  # vLLM's; -1 (or 0): off
    "seed": _setting(c.SEED),
    "stop": _ANY,
    "stream": _BOOL,
    "stream_options": Field(dict, fields={"include_usage": _BOOL,
                                          "continuous_usage_stats": _BOOL}),  # the second: vLLM's
    "response_format": _ANY,
    "tools": _ANY,
    "tool_choice": _ANY,
    "parallel_tool_calls": _BOOL,
    "answer_cache": _BOOL,  # this server's: false keeps the request out of the answer cache
    # vLLM's: images' and videos' budgets for the whole request (chat_messages.py).
    MM_PROCESSOR_KWARGS: Field(dict),
    # Accepted and without effect on the answer.
    "user": _ANY,
    "metadata": _ANY,
    "service_tier": _ANY,
    # Fields the deployment cannot honour (null always counts as absent). The refusal names
    # the field: a client that relies on it learns so at once instead of getting a silently
    # different answer.
    "n": Field(only=(1,)),
    "logprobs": Field(only=(False,)),
    "top_logprobs": Field(only=(0,)),
    "presence_penalty": Field(only=(0, 0.0)),
    "frequency_penalty": Field(only=(0, 0.0)),
    "repetition_penalty": Field(only=(1, 1.0)),
    "logit_bias": Field(only=({},)),
    "functions": Field(only=([],)),  # OpenAI's deprecated spelling of tools: send tools
    "function_call": Field(only=("none",)),
    "modalities": Field(only=(["text"],)),
    "store": Field(only=(False,)),
    "audio": Field(only=()),
    "prediction": Field(only=()),
    "reasoning_effort": Field(only=()),
    "web_search_options": Field(only=()),
}


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """The request body -> a checked request, or ApiError (400) naming the field and the
    fix."""
    data = _json_object(body)
    fields = _checked(data, FIELDS)
    messages = fields["messages"]
    for name in ("messages", "tools", "response_format"):  # the texts that travel
        _check_texts(data.get(name), name)
    with _as_param():
        check_tool_turns(messages)
        check_budgets(messages, fields.get(MM_PROCESSOR_KWARGS))
    stream = fields.get("stream", False)
    include_usage, continuous_usage = _stream_options(fields.get("stream_options"), stream)
    max_tokens, min_tokens = _max_tokens(fields), fields.get("min_tokens")
    ignore_eos = fields.get("ignore_eos", False)
    structure = _structure(data, fields.get("parallel_tool_calls"))
    with _as_param():
        if min_tokens is not None and max_tokens is not None:
            c.check_min_tokens(min_tokens, max_tokens)
        if structure.schema is not None:
            # Here, not at the top: only a guided request loads guided decoding's module
            # (and its thread pool's), which an unguided gateway does without.
            from ..llm.guided import check_guided_ending

            check_guided_ending(not ignore_eos, min_tokens or 0)
    if structure.schema is not None and data.get("stop"):
        raise bad_request("stop with a guided answer (response_format, tool_choice required "
                          "or named): a stop string inside the structure would cut it short "
                          "of its schema; the answer ends with the structure, leave stop out",
                          "stop")
    top_p, top_k = _fp32(fields, "top_p"), fields.get("top_k")
    top_k = 0 if top_k == -1 else top_k  # vLLM spells "off" -1, the ensemble 0
    if top_p == 0:  # OpenAI takes it: the smallest nucleus, the most likely token alone
        top_p, top_k = None, 1
    return ChatCompletionRequest(
        model=fields["model"], messages=messages, max_tokens=max_tokens,
        temperature=_fp32(fields, "temperature"), top_p=top_p,
        top_k=top_k, seed=fields.get("seed"), stop=_stop(data), stream=stream,
        include_usage=include_usage, continuous_usage=continuous_usage,
        min_tokens=min_tokens, ignore_eos=ignore_eos, structure=structure,
        answer_cache=fields.get("answer_cache", True),
        mm_processor_kwargs=fields.get(MM_PROCESSOR_KWARGS))


def _checked(data: Mapping[str, Any], table: Mapping[str, Field],
             where: str | None = None) -> dict[str, Any]:
    """The fields of `data` (the body, or the object at `where`) that are present and not
    null, each checked by its entry of `table`; ApiError 400 for a field `table` lacks."""
    unknown = sorted(set(data) - set(table))
    if unknown and where is None:
        raise bad_request(f"unsupported parameter {unknown[0]!r}: this server does not know "
                          "it; leave it out", unknown[0])
    if unknown:
        names = list(table)
        raise bad_request(f"{where} supports only {', '.join(names[:-1])} and {names[-1]}",
                          where)
    values = {}
    for name, field in table.items():
        param = name if where is None else f"{where}.{name}"
        if data.get(name) is not None:
            values[name] = field.check(data[name], param)
        elif field.required:
            raise bad_request(field.required, param)
    return values


@contextmanager
def _as_param() -> Iterator[None]:
    """A rule of the deployment's broken (FieldError) -> a 400 with its words, naming its
    field as OpenAI's param."""
    try:
        yield
    except FieldError as exc:
        raise bad_request(str(exc), exc.field) from None


# ---- structured output: response_format, tools, tool_choice ---------------------------------

# OpenAI's rule for function and response-format names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _structure(data: Mapping[str, Any], parallel: bool | None) -> Structure:
    """response_format, tools, tool_choice and parallel_tool_calls, checked, and what they
    ask of the deployment. One guide per request: a response format with a forced call is
    refused; with tool_choice auto the format wins (a guided JSON answer calls no tool)."""
    schema = _response_format(data.get("response_format"))
    tools = _tools(data.get("tools"))
    choice = data.get("tool_choice")
    # OpenAI's rule; "none" without tools asks for nothing, and is taken.
    for name, value in (("tool_choice", None if choice == "none" else choice),
                        ("parallel_tool_calls", parallel)):
        if value is not None and not tools:
            raise bad_request(f"{name} is only allowed when tools are specified; send tools "
                              f"or leave {name} out", name)
    parallel = True if parallel is None else parallel
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("none", "auto"):
        answer = Answer.TAGGED_CALLS if tools and choice == "auto" and schema is None \
            else Answer.TEXT
        return Structure(tools, *(schema or (None, None)), answer,
                         parallel_tool_calls=parallel)
    if choice != "required":
        choice = {"name": _named_choice(choice)}
    if schema is not None:
        raise bad_request("response_format and a forced tool call (tool_choice required or "
                          "a named function) both guide the answer; send one of them",
                          "response_format")
    functions = [t["function"] for t in tools]
    if choice == "required":
        for i, function in enumerate(functions):
            _guided_schema(_parameters(function), f"tools[{i}].function.parameters")
        return Structure(tools, _dumps(_call_list_schema(functions, parallel)), "tools",
                         Answer.CALL_LIST, parallel_tool_calls=parallel)
    names = [f["name"] for f in functions]
    if choice["name"] not in names:
        raise bad_request(f"tool_choice names the function {choice['name']!r}, which is not "
                          f"among tools ({', '.join(names)}); name one of them", "tool_choice")
    i = names.index(choice["name"])
    param = f"tools[{i}].function.parameters"
    return Structure(tools, _dumps(_guided_schema(_parameters(functions[i]), param)), param,
                     Answer.NAMED_CALL, choice["name"], parallel)


def _guided_schema(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """`schema`, if it is inside the subset a guide holds to (schema_subset.py); else a 400
    naming the keyword, its place and `param`."""
    try:
        check_schema(schema)
    except SchemaError as exc:
        where = f"{param}.{exc.path}" if exc.path else param
        raise bad_request(f"{where} {exc}", param) from None
    return schema


# OpenAI's json_object: any JSON object (xgrammar keeps the additional properties a schema
# allows explicitly, also in its strict mode).
ANY_OBJECT = {"type": "object", "additionalProperties": True}


def _response_format(value: Any) -> tuple[str, str] | None:
    """None for text; else (the schema's JSON text, the field that gave it): json_object's
    any object, or json_schema's schema (strict or not: it is enforced either way)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return _dumps(ANY_OBJECT), "response_format"
    if kind != "json_schema":
        raise bad_request(f"response_format = {json.dumps(value)[:60]} is not supported; send "
                          '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}}}', "response_format")
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, Mapping):
        raise bad_request('response_format json_schema needs "json_schema": {"name": ..., '
                          '"schema": {...}} beside its type, and nothing else',
                          "response_format.json_schema")
    _named_spec(spec, "response_format.json_schema", "schema")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object, got "
                          f"{json.dumps(schema)[:40]}; send e.g. {{\"type\": \"object\", "
                          "\"properties\": {...}}", "response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return _dumps(_guided_schema(dict(schema), param)), param


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Function tools, checked; None for none."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list of {type: function, function: {name, "
                          "description, parameters}} objects", "tools")
    names = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise bad_request(f"{where}.type = {json.dumps(kind)[:40]} is not supported: this "
                              "server calls function tools only; send type function",
                              f"{where}.type")
        function = tool.get("function")
        if set(tool) - {"type", "function"} or not isinstance(function, Mapping):
            raise bad_request(f"{where} must be {{type: function, function: {{name, "
                              "description, parameters, strict}}}", where)
        name = _named_spec(function, f"{where}.function", "parameters")
        if name in names:
            raise bad_request(f"{where}.function.name {name!r} names a second function; give "
                              "each function its own name", f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, Mapping)
                                       or parameters.get("type", "object") != "object"):
            # OpenAI's rule: a function takes named arguments, an object.
            raise bad_request(f"{where}.function.parameters must be a JSON schema of type "
                              f"object, got {json.dumps(parameters)[:60]}",
                              f"{where}.function.parameters")
    return value


_SPEC_FIELDS = {"strict": _BOOL, "description": Field(str)}


def _named_spec(spec: Mapping[str, Any], where: str, body: str) -> str:
    """A json_schema's or a function's fields: name (OpenAI's rule), description, strict and
    `body` (its schema), nothing else; its name."""
    fields = ("name", "description", body, "strict")
    unknown = sorted(set(spec) - set(fields))
    if unknown:
        raise bad_request(f"{where}.{unknown[0]} is not supported; send {', '.join(fields[:-1])} "
                          f"and {fields[-1]} only", f"{where}.{unknown[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, _ or -",
                          f"{where}.name")
    for key, field in _SPEC_FIELDS.items():
        if spec.get(key) is not None:
            field.check(spec[key], f"{where}.{key}")
    return name


def _named_choice(choice: Any) -> str:
    """The function name of {"type": "function", "function": {"name": ...}}."""
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if isinstance(function, Mapping) and set(choice) == {"type", "function"} and \
            choice["type"] == "function" and set(function) == {"name"} and \
            isinstance(function["name"], str):
        return function["name"]
    raise bad_request(f"tool_choice = {json.dumps(choice)[:60]} is not supported; send none, "
                      'auto, required or {"type": "function", "function": {"name": ...}}',
                      "tool_choice")


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none is an empty parameter list (OpenAI's rule)."""
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def _call_list_schema(functions: Sequence[Mapping[str, Any]],
                      parallel: bool) -> dict[str, Any]:
    """The schema of tool_choice required's answer: a list of one or more calls (one without
    parallel calls), each {name, parameters} of one of the functions. vLLM's choice for the
    same (vllm/entrypoints/openai/protocol.py ChatCompletionRequest._get_json_schema_from_tool:
    an array anyOf {name: enum [the name], parameters: the schema}); the stock backend's
    C++ guided decoder compiles json_schema with xgrammar in every version, while it does not
    take structural tags in every one (TensorRT-LLM cpp/tensorrt_llm/batch_manager/
    guidedDecoder.cpp, xgrammarFactory.cpp). Each function's $defs move to the root, where
    their references (#/$defs/...) point."""
    defs: dict[str, Any] = {}
    calls = []
    for function in functions:
        parameters = _parameters(function)
        for key, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, schema) != schema:
                raise bad_request(f"two functions define $defs {key!r} differently; give "
                                  "their definitions distinct names", "tools")
        calls.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _stream_options(options: Mapping[str, bool] | None, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of the checked stream_options."""
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    include, continuous = (options.get(name, False) for name in FIELDS["stream_options"].fields)
    if continuous and not include:
        raise bad_request("stream_options.continuous_usage_stats needs include_usage true: "
                          "send both", "stream_options.continuous_usage_stats")
    return include, continuous


def _check_texts(value: Any, name: str) -> None:
    """Every string of a field (keys too) can travel as UTF-8; the refusal names the field,
    e.g. messages[0].content. Walked without recursion: JSON may nest deeply."""
    todo: list[tuple[str, Any]] = [(name, value)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            _text(value, path, path)
        elif isinstance(value, list):
            todo += ((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, Mapping):
            for key, v in value.items():
                _text(key, f"a key of {path}", path)
                todo.append((f"{path}.{key}", v))


def _text(text: str, where: str, param: str) -> None:
    try:
        c.text_bytes(text, where)
    except InputError as exc:
        raise bad_request(str(exc), param) from None


def _json_object(body: bytes) -> dict[str, Any]:
    def no_constant(name: str) -> Any:  # NaN, Infinity: not JSON
        raise ValueError(f"{name} is not a JSON number")

    separators = body.count(b",") + body.count(b"[") + body.count(b"{")
    if separators > MAX_JSON_SEPARATORS:
        raise ApiError(413, f"the request body holds {separators} JSON separators (, [ {{), "
                       f"above the {MAX_JSON_SEPARATORS} a request may have; send fewer "
                       "values", code="request_too_large")

    try:
        data = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") \
            from None
    except RecursionError:  # the parser's own bound on nesting
        raise bad_request("the request body nests its JSON too deeply for this server; send "
                          "a flatter body") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_nesting(data)
    return data


def _check_nesting(data: dict[str, Any]) -> None:
    """Refuse a body nested deeper than contract.MAX_JSON_DEPTH, naming the first field that
    is (the top-level field as `param`)."""
    for name, value in data.items():
        try:
            c.check_depth(value, name)
        except InputError as exc:
            raise bad_request(str(exc), name) from None


def _canonical(value: Any) -> str:
    """A JSON value's spelling, so that true is not 1 (Python's True == 1)."""
    return json.dumps(value, sort_keys=True)


def _max_tokens(fields: Mapping[str, Any]) -> int | None:
    given = {fields[name] for name in ("max_completion_tokens", "max_tokens") if name in fields}
    if len(given) > 1:
        raise bad_request("max_tokens and max_completion_tokens differ; send one of them",
                          "max_tokens")
    return given.pop() if given else None


def _fp32(fields: Mapping[str, Any], name: str) -> float | None:
    """A number of an FP32 input of the ensemble (temperature, top_p)."""
    value = fields.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    with _as_param():
        return c.fp32(number, name)


def _stop(data: Mapping[str, Any]) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request("stop must be a string or a list of strings", "stop")
    for i, word in enumerate(words):
        _text(word, "stop" if isinstance(stop, str) else f"stop[{i}]", "stop")
    return tuple(words)


# ---- responses ------------------------------------------------------------------------------

def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int,
          media_tokens: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `media_tokens`: the prompt's (image, video) tokens, reported as
    prompt_tokens_details.image_tokens and .video_tokens (this server's extension; None, from
    a repository that does not report them: no details)."""
    counts: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    if media_tokens is not None:
        counts["prompt_tokens_details"] = dict(zip(c.MEDIA_TOKEN_OUTPUTS, media_tokens,
                                                   strict=True))
    return counts


def completion(ident: str, created: int, model: str, message: dict[str, Any], finish: str,
               counts: dict[str, int]) -> dict[str, Any]:
    """The `chat.completion` object of a non-streamed answer (`message`: the assistant's,
    content and any tool calls)."""
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish}],
            "usage": counts}


class ChunkWriter:
    """The `chat.completion.chunk` events of one streamed answer, as SSE `data:` lines."""

    def __init__(self, model: str, *, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.head = {"id": completion_id(), "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage

    def event(self, delta: dict[str, Any], finish: str | None = None,
              counts: dict[str, int] | None = None) -> bytes:
        """`counts`: the usage so far, which a chunk carries with continuous_usage."""
        chunk = {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish}]}
        if self.include_usage:
            # OpenAI: every chunk but the last carries a null usage; vLLM's
            # continuous_usage_stats: the usage so far.
            chunk["usage"] = counts if self.continuous_usage else None
        return sse(chunk)

    def usage_event(self, counts: dict[str, int]) -> bytes:
        return sse({**self.head, "choices": [], "usage": counts})


DONE = b"data: [DONE]\n\n"


def sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def models_list(cards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": list(cards)}


def model_card(name: str, created: int, root: str, max_model_len: int,
               limits: dict[str, int], builds: list[str]) -> dict[str, Any]:
    """`root`: the checkpoint the model serves (vLLM's field; a client such as AIPerf takes
    its tokenizer by that name); `max_model_len` (vLLM's) and `limits`: what it admits per
    request; `builds`: the ensembles that answer it."""
    return {"id": name, "object": "model", "created": created, "owned_by": "qvl-trt",
            "root": root, "parent": None, "max_model_len": max_model_len, "limits": limits,
            "builds": builds}
