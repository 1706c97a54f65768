"""The JSON Schema subset a guided answer may be held to, checked at the edges (the gateway's
request, preprocessing's json_schema and regex guides: llm/guided.py Guide.check): what xgrammar
0.1.32 (TensorRT-LLM 1.2.1's pin; 0.1.25 converts the same) turns into a grammar that admits
exactly the schema's instances and does so cheaply, much as OpenAI's structured outputs accept a
documented subset and refuse the rest. Anything else is a 400 naming the keyword and where it
is: a keyword the converter drops would make a guide that admits answers the schema does not,
and one it converts dearly would slow every other request of the step (the mask is made on the
step's thread, in the stock executor too: llm/guided.py).

The table (docs/openai.md "Supported schemas" prints it) and the bounds are defined once here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import InputError

JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
# Keywords of any schema, and those each type adds. Annotations are taken and do not guide.
ANNOTATIONS = ("title", "description", "default", "examples", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly")
GENERIC = ("type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
           *ANNOTATIONS)
BY_TYPE = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "string": ("pattern", "format", "minLength", "maxLength"),
}
SUPPORTED = frozenset(GENERIC).union(*BY_TYPE.values())
# The converter guides by one keyword of a schema, the first of these it finds, and drops
# every other (json_schema_converter.cc, the dispatch in VisitSchema): beside one of them only
# annotations may stand, and a type beside an enum or const (whose values say it again).
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "allOf")
FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
           "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
_RANGE = "xgrammar 0.1.32 builds wrong grammars for numeric ranges (single-digit and negative " \
    "bounds admit numbers outside them, a fractional one admits non-JSON text, exclusive bounds " \
    "are inclusive): leave the bound out and check it after"
# Why the others are refused, by keyword (the refusal says it).
REFUSED = {
    "oneOf": "xgrammar reads it as anyOf, so an answer may match two branches: use anyOf",
    "not": "xgrammar cannot guide a negation",
    "if": "xgrammar cannot guide conditions", "then": "xgrammar cannot guide conditions",
    "else": "xgrammar cannot guide conditions",
    "multipleOf": "xgrammar ignores it", "uniqueItems": "xgrammar ignores it",
    "contains": "xgrammar ignores it", "minContains": "xgrammar ignores it",
    "maxContains": "xgrammar ignores it", "dependentRequired": "xgrammar ignores it",
    "dependentSchemas": "xgrammar ignores it", "dependencies": "xgrammar ignores it",
    "additionalItems": "xgrammar ignores it",
    "patternProperties": "xgrammar then ignores properties and required",
    "minimum": _RANGE, "maximum": _RANGE, "exclusiveMinimum": _RANGE,
    "exclusiveMaximum": _RANGE,
}
# Bounds, each a cost measured with xgrammar 0.1.25 and Qwen's 151k-token vocabulary
# (scripts/bench_guide_cost.py): the converter expands a bounded string into a repetition
# whose token mask is made anew at its tokens, on average ~0.014 s of CPU a token at 4
# characters, ~0.07 s at 8 and ~0.5 s from 16 on, for every guided request of the step; a
# counted repetition in a pattern costs alike (more for a broad class). 0.1.32 fills these
# masks 6-66 times faster (maxLength 16: ~4 ms a token); the bounds stay, since a base may
# carry 0.1.25 (deploy/trtllm_container.toml accepts it) and 0.1.32 compiles no faster.
MAX_STRING_BOUND = 4  # minLength, maxLength, and {m,n} counts in a pattern
MAX_NESTING = 10  # schemas within schemas (OpenAI's limit)
MAX_PROPERTIES = 200  # object properties in all: compiling is quadratic in optional ones
# (0.3 s at 200, 1.2 s at 500), once per distinct schema, on the stock executor's step
MAX_ENUM_VALUES = 1000  # enum values in all (OpenAI's limit)
MAX_SCHEMA_BYTES = 64 * 1024  # the schema's JSON text
_COUNTED = re.compile(r"(?<!\\)\{(\d+)(,?)(\d*)\}")
# Characters a property name may not hold: xgrammar 0.1.25 (and 0.1.32) writes such names into the
# grammar unescaped (a backslash came back as a raw control character).
_UNSAFE_NAME = re.compile(r'["\\\x00-\x1f\x7f]')


class SchemaError(InputError):
    """A schema outside the subset or its bounds; `path` is where in the schema (e.g.
    `properties.a.items`, "" for the whole)."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(what)
        self.path = path


def check_schema(schema: Mapping[str, Any]) -> None:
    """Refuse (SchemaError) a schema outside the subset or its bounds, naming the keyword and
    its path."""
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > MAX_SCHEMA_BYTES:
        _refuse("", f"is {size} characters of JSON, above the {MAX_SCHEMA_BYTES} a "
                "guided schema may have")
    counts = {"properties": 0, "enum": 0}
    todo: list[tuple[str, Any, int]] = [("", schema, 1)]
    while todo:
        path, node, depth = todo.pop()
        if isinstance(node, bool):  # true: anything, false: nothing
            continue
        if not isinstance(node, Mapping):
            _refuse(path, f"is {json.dumps(node)[:40]}, not a schema (an object or a "
                    "boolean)")
        if depth > MAX_NESTING:
            _refuse(path, f"nests schemas {depth} deep, above the {MAX_NESTING} a guided "
                    "schema may")
        todo += _children(node, path, depth, schema, counts)
    if counts["properties"] > MAX_PROPERTIES:
        _refuse("", f"has {counts['properties']} properties, above the "
                f"{MAX_PROPERTIES} a guided schema may have")
    if counts["enum"] > MAX_ENUM_VALUES:
        _refuse("", f"has {counts['enum']} enum values, above the {MAX_ENUM_VALUES} a "
                "guided schema may have")


def _children(node: Mapping[str, Any], path: str, depth: int, root: Mapping[str, Any],
              counts: dict[str, int]) -> list[tuple[str, Any, int]]:
    """Check one schema's own keywords; its subschemas, to check next."""
    for key in node:
        if key not in SUPPORTED:
            why = REFUSED.get(key, "it is not in the supported subset")
            _refuse(_at(path, key), f"uses {key!r}, which is not supported: {why} "
                    "(docs/openai.md lists what is)")
    _check_type(node.get("type"), _at(path, "type"))
    _check_one_guide(node, path)
    children = []
    for key in ("properties", "$defs", "definitions"):
        if key not in node:
            continue
        value = node[key]
        if not isinstance(value, Mapping):
            _refuse(_at(path, key), "must be an object of schemas")
        if key == "properties":
            counts["properties"] += len(value)
            for name in value:
                if _UNSAFE_NAME.search(name):
                    _refuse(_at(path, key), f"names a property {name[:40]!r} with a "
                            'quote, backslash or control character; rename it')
        children += [(_at(path, f"{key}.{name}"), sub, depth + 1) for name, sub in value.items()]
    for key in ("items", "additionalProperties"):
        if key in node:
            children.append((_at(path, key), node[key], depth + 1))
    if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) != 1):
        _refuse(_at(path, "allOf"), "must hold one schema: xgrammar guides more than one "
                "as any value; merge them into one")
    for key in ("anyOf", "allOf", "prefixItems"):
        if key in node:
            value = node[key]
            if not isinstance(value, list) or not value:
                _refuse(_at(path, key), "must be a non-empty list of schemas")
            children += [(_at(path, f"{key}[{i}]"), sub, depth + 1) for i, sub in enumerate(value)]
    _check_required(node, path)
    _check_values(node, path, counts)
    if "$ref" in node:
        _check_ref(node["$ref"], _at(path, "$ref"), root)
    return children


def _check_one_guide(node: Mapping[str, Any], path: str) -> None:
    """Refuse keywords the converter would drop: beside an exclusive keyword (EXCLUSIVE),
    and a type's keywords where the schema does not say it is of that type (without a type,
    `{"maxLength": 3}` guides any value), or where it says it is of several."""
    guiding = [k for k in node if k not in ANNOTATIONS and k not in ("$defs", "definitions")]
    first = next((k for k in EXCLUSIVE if k in node), None)
    if first is not None:
        extra = [k for k in guiding if k != first and (k != "type" or first in ("$ref",
                                                                              "anyOf", "allOf"))]
        if extra:
            _refuse(_at(path, extra[0]), f"stands beside {first!r}, and xgrammar guides by "
                    f"{first!r} alone; move it into the schema {first!r} names")
        return
    declared = node.get("type")
    for kind, keys in BY_TYPE.items():
        used = [k for k in keys if k in node]
        if not used or (kind == "object" and declared is None):  # properties imply an object
            continue
        if declared != kind:
            _refuse(_at(path, used[0]), f"needs \"type\": \"{kind}\" in the same schema "
                    f"(it has {json.dumps(declared)}); xgrammar guides it there only")
    if node.get("additionalProperties") not in (None, False) and node.get("properties"):
        _refuse(_at(path, "additionalProperties"), "beside properties must be false: xgrammar "
                "0.1.32 then admits wrong types for optional properties")
    if "format" in node:
        if node["format"] not in FORMATS:
            _refuse(_at(path, "format"), f"is {json.dumps(node['format'])[:40]}, which "
                    f"xgrammar does not guide; use one of {', '.join(FORMATS)}, or pattern")
        if any(k in node for k in ("pattern", "minLength", "maxLength")):
            _refuse(_at(path, "format"), "stands beside pattern or a length, which xgrammar "
                    "then drops; send one of them")
    if "pattern" in node and any(k in node for k in ("minLength", "maxLength")):
        _refuse(_at(path, "pattern"), "stands beside minLength or maxLength, which xgrammar "
                "then drops; put the length into the pattern")


def _check_type(value: Any, where: str) -> None:
    types = value if isinstance(value, list) else [value]
    if value is not None and (not types or not all(t in JSON_TYPES for t in types)):
        _refuse(where, f"is {json.dumps(value)[:40]}; a type is one of "
                f"{', '.join(JSON_TYPES)} or a list of them")


def _check_required(node: Mapping[str, Any], path: str) -> None:
    required = node.get("required")
    if required is None:
        return
    names = node.get("properties") or {}
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        _refuse(_at(path, "required"), "must be a list of property names")
    missing = [n for n in required if n not in names]
    if missing:
        _refuse(_at(path, "required"), f"names {missing[0][:40]!r}, which is not among "
                "its properties; add it to properties or leave it out of required")


def _check_values(node: Mapping[str, Any], path: str, counts: dict[str, int]) -> None:
    if "enum" in node:
        if not isinstance(node["enum"], list) or not node["enum"]:
            _refuse(_at(path, "enum"), "must be a non-empty list of values")
        counts["enum"] += len(node["enum"])
    for key in ("minLength", "maxLength", "minItems", "maxItems"):
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            _refuse(_at(path, key), "must be a whole number, 0 or more")
        if key in ("minLength", "maxLength") and value is not None and value > MAX_STRING_BOUND:
            _refuse(_at(path, key), f"is {value}, above the {MAX_STRING_BOUND} a guided "
                    "string may be bounded by (each bounded character costs every request of "
                    "the step CPU time per token): leave strings unbounded, or send an enum")
    pattern = node.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            _refuse(_at(path, "pattern"), "must be a regular expression string")
        check_pattern(pattern, _at(path, "pattern"))


def check_pattern(pattern: str, path: str = "") -> None:
    """Refuse (SchemaError) a regular expression with a counted repetition above
    MAX_STRING_BOUND."""
    for low, comma, high in _COUNTED.findall(pattern):
        most = int(high) if high else (None if comma else int(low))
        if int(low) > MAX_STRING_BOUND or (most or 0) > MAX_STRING_BOUND:
            _refuse(path, f"repeats {{{low}{comma}{high}}}: counted repetitions above "
                    f"{MAX_STRING_BOUND} cost every request of the step CPU time per token; "
                    "use * or + instead")


def _check_ref(ref: Any, where: str, root: Mapping[str, Any]) -> None:
    """A reference within the schema ("#", "#/$defs/name", ...), that resolves."""
    if not isinstance(ref, str) or not ref.startswith("#") or "~" in ref or "%" in ref:
        _refuse(where, f"is {json.dumps(ref)[:60]}: only plain references within the schema "
                "(#/$defs/name) are followed (xgrammar guides any other as any value); put "
                "the definition in $defs")
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        if not isinstance(node, Mapping) or part not in node:
            _refuse(where, f"{ref[:60]!r} points at nothing in the schema")
        node = node[part]


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _refuse(path: str, what: str) -> None:
    raise SchemaError(path, what)
