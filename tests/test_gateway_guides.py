"""The guide the gateway sends for a structured answer: the schema's grammar without free
whitespace, compiled in the gateway (a bad schema is the request's 400, naming its field,
and never reaches the executor's step)."""

from __future__ import annotations

import asyncio
import json

import pytest

from qvl_trt.gateway.guides import EBNF_GRAMMAR, compact_grammar, guide
from qvl_trt.gateway.openai_api import ANY_OBJECT, ApiError, Structure

xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer"}},
          "required": ["a"]}


def accepts(grammar: str, text: str) -> bool:
    """Whether xgrammar's grammar takes `text` whole (as the executor's matcher would)."""
    matcher = xgrammar.testing._get_matcher_from_grammar(xgrammar.Grammar.from_ebnf(grammar))
    return matcher.accept_string(text) and matcher.is_terminated()


def test_the_guide_is_the_schemas_grammar_without_free_whitespace() -> None:
    kind, grammar = asyncio.run(guide(Structure(schema=json.dumps(SCHEMA),
                                                schema_param="response_format")))
    assert kind == EBNF_GRAMMAR
    assert accepts(grammar, '{"a": "x", "b": 12}') and accepts(grammar, '{"a": "y"}')
    for text in ('{ "a": "x"}', '{"a": "x"}\n', '{"a":\n"x"}',  # free blanks
                 '{"a": "z"}', '{"b": 1}', '[]'):  # not the schema's
        assert not accepts(grammar, text), text
    objects = compact_grammar(json.dumps(ANY_OBJECT))  # json_object: any object, no array
    assert accepts(objects, '{"k": [1, {"n": null}]}') and not accepts(objects, "[1]")
    assert asyncio.run(guide(Structure())) is None


@pytest.mark.parametrize("schema", [{"type": "object", "properties": 5}, {"type": "nothing"},
                                    {"$ref": "#/$defs/missing"}])
def test_a_schema_that_does_not_compile_is_the_requests_400(schema) -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(guide(Structure(schema=json.dumps(schema),
                                    schema_param="tools[1].function.parameters")))
    error = caught.value
    assert error.status == 400 and error.param == "tools[1].function.parameters"
    assert error.message.startswith("tools[1].function.parameters: the JSON schema does not "
                                    "compile: "), error.message


# ---- every guided answer called complete validates -----------------------------------------

GUIDED = Structure(schema=json.dumps(SCHEMA), schema_param="response_format.json_schema.schema")


@pytest.mark.parametrize("text, words", [
    ('{"a": "z"}', "does not validate against response_format.json_schema.schema at ['a']"),
    ('{"b": 1}', "at its root: 'a' is a required property"),
    ('{"a": "x", "b": 1.5}', "at ['b']"),
    ("006", "is not JSON"),  # what a fractional range guided to
    ("12", "at its root"),  # a number where an object was promised
    ('{"a": "x\t"}', "is not JSON"),  # a raw control character in a string
    ('{"a": "x"', "is not JSON"),
])
def test_a_stopped_answer_outside_its_schema_is_an_error_not_a_stop(text, words) -> None:
    from qvl_trt.gateway.guides import check_answer

    with pytest.raises(ApiError) as caught:
        check_answer(GUIDED, text, "stop")
    error = caught.value
    assert error.status == 500 and error.code == "guided_answer_invalid"
    assert words in error.message, error.message


def test_answers_that_keep_the_promise_or_were_cut_pass() -> None:
    from qvl_trt.gateway.guides import check_answer

    check_answer(GUIDED, '{"a": "x", "b": 2}', "stop")
    check_answer(GUIDED, '{"a": "x", "b"', "length")  # cut by max_tokens: not complete
    check_answer(Structure(), "free text", "stop")  # unguided


def test_the_grammar_cache_is_bounded_in_characters() -> None:
    from qvl_trt.gateway import guides
    from qvl_trt.lru import BytesLru

    small = BytesLru(4000, lambda schema, grammar: len(schema) + len(grammar))
    original, guides._grammars = guides._grammars, small
    try:
        for i in range(40):
            compact_grammar(json.dumps({"enum": [f"v{i}-{'x' * 50}"]}))
        stats = small.stats()
        assert stats.bytes <= 4000 and 0 < stats.entries < 40
    finally:
        guides._grammars = original
