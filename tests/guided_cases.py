"""The guides the guided-decoding tests send, on the reference flavor and on the GPU tier."""

from __future__ import annotations

# Nested objects, an enum, an array and required fields; strings and arrays are bounded so
# that the tiny random model, whose free text is gibberish, completes the structure.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
PATTERN = r"(yes|no), [0-9]{1,3} (cats|dogs)"
# A schema xgrammar rejects: it fails inside the executor's step.
BAD_SCHEMA = '{"type": "object", "properties": 5}'
