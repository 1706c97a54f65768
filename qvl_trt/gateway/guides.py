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
import functools

from ..deps import require
from ..errors import InputError
from .openai_api import Structure, bad_request

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


@functools.lru_cache(maxsize=256)
def compact_grammar(schema: str) -> str:
    """The EBNF grammar of `schema` (JSON text) without free whitespace."""
    require("xgrammar", extra="gateway", why="guide structured answers (response_format, "
            "tool_choice)")
    from ..llm.guided import compact_json_schema

    return compact_json_schema(schema)
