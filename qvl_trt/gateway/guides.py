"""The guide the gateway sends for a structured answer: the request's JSON schema (a
response_format's, the call list of tool_choice required, a named function's parameters) as
an EBNF grammar of that JSON without free whitespace (the stock backend's `ebnf_grammar`
guide type), compiled here before the request goes on.

Why not the `json_schema` and `json` guide types: the executor compiles them with
xgrammar's any_whitespace and no limit on it, so a model can pad an unfinished object with
blanks until max_tokens (llm/guided.py, compact_json_schema); `json`'s builtin grammar also
takes arrays, where OpenAI's json_object is an object. Why here: a guide that does not compile
fails inside the executor's step, and with it every other request of that step (llm/guided.py,
FORWARD_ERROR); compiled first, a bad schema is this request's 400, naming its field.

xgrammar (with torch, which it imports) loads at the first structured request, in a worker
thread; grammars are cached by schema, as clients repeat theirs.
"""

from __future__ import annotations

import asyncio
import json

from ..deps import require
from ..errors import InputError
from ..lru import BytesLru
from .openai_api import ApiError, Structure, bad_request

# The stock backend's guide type of what `guide` returns (llm.guided.GuideType.EBNF_GRAMMAR;
# not imported: the gateway loads xgrammar only when a request needs it).
EBNF_GRAMMAR = "ebnf_grammar"


async def guide(structure: Structure) -> tuple[str, str] | None:
    """(guided_decoding_guide_type, guided_decoding_guide) for the request, or None for an
    unguided one; ApiError 400 for a schema that does not compile."""
    if structure.schema is None:
        return None
    try:
        grammar = await asyncio.to_thread(compact_grammar, structure.schema)
    except InputError as exc:
        raise bad_request(f"{structure.schema_param}: {exc}; send a JSON schema xgrammar "
                          "takes (docs/openai.md)", structure.schema_param) from None
    return EBNF_GRAMMAR, grammar


# Grammars by schema, as clients repeat theirs: at most this many characters of schema and
# grammar text in all (the least recently used go first).
GRAMMAR_CACHE_CHARS = 64 * 2**20
_grammars: BytesLru[str, str] = BytesLru(GRAMMAR_CACHE_CHARS,
                                         lambda schema, grammar: len(schema) + len(grammar))


def compact_grammar(schema: str) -> str:
    """The EBNF grammar of `schema` (JSON text) without free whitespace."""
    grammar = _grammars.get(schema)
    if grammar is None:
        require("xgrammar", extra="gateway", why="guide structured answers (response_format, "
                "tool_choice)")
        from ..llm.guided import compact_json_schema

        grammar = compact_json_schema(schema)
        _grammars.put(schema, grammar)
    return grammar


def check_answer(structure: Structure, text: str, finish: str) -> None:
    """A guided answer that ended by itself must be an instance of its schema before it is
    called complete: a grammar can admit text its schema does not (xgrammar's converter leaves
    some keywords to the schema alone, docs/openai.md), and a client was promised the schema.
    ApiError 500 naming the first violation; an answer cut at max_tokens ("length") is
    incomplete by its finish reason and not checked."""
    if structure.schema is None or finish != "stop":
        return
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _broken(structure, f"is not JSON ({exc})") from None
    jsonschema = require("jsonschema", extra="gateway", why="check guided answers")
    validator = jsonschema.Draft202012Validator(json.loads(structure.schema))
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or "its root"
        raise _broken(structure, f"does not validate against {structure.schema_param} at "
                      f"{where}: {error.message[:200]}")


def _broken(structure: Structure, what: str) -> ApiError:
    return ApiError(500, f"the guided answer {what}; the deployment's guide did not hold "
                    "(a fault to report: the answer is withheld, not called complete)",
                    type="server_error", code="guided_answer_invalid",
                    param=structure.schema_param)
