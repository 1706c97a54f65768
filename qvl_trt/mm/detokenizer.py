"""Incremental detokenization for streamed answers: the served postprocessing model and the
in-process reference pipeline both stream through `StreamDecoder`.

Qwen's byte-level BPE maps every token to fixed bytes; a character may be split across tokens
(a CJK character or an emoji is often two or three byte tokens). Decoding each streamed
delta on its own would turn such splits into replacement characters. Here each stream keeps
the bytes of an incomplete character until the next tokens complete it: the concatenated
deltas equal `tokenizer.decode(all_ids, skip_special_tokens=True)`.

Not the `tokenizers` library's own incremental decoder (`decoders.DecodeStream`): it has no
flush, so a stream ending inside a character never gets the replacement character the
one-shot decode ends with, and it holds back a lone continuation byte or a literal U+FFFD
until a later token where this emits it at once (tests/test_mm_detokenizer.py compares them).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from pathlib import Path


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE files."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


class TokenBytes:
    """Token id -> the bytes it decodes to; special tokens and ids outside the vocabulary
    decode to nothing (skip_special_tokens)."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> TokenBytes:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        char_byte = {char: byte for byte, char in byte_to_unicode().items()}
        vocab: dict[str, int] = document["model"]["vocab"]
        added = document.get("added_tokens", [])
        size = 1 + max([*vocab.values(), *(t["id"] for t in added)])
        table = [b""] * size
        for token, token_id in vocab.items():
            table[token_id] = bytes(char_byte[c] for c in token)
        for token in added:
            table[token["id"]] = b"" if token["special"] else token["content"].encode()
        return cls(table)

    def __call__(self, ids: Iterable[int]) -> bytes:
        table, n = self._table, len(self._table)
        return b"".join(table[i] for i in ids if 0 <= i < n)


class StreamDecoder:
    """Text of one stream, delta by delta."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens = 0

    def push(self, ids: Iterable[int], *, final: bool = False) -> str:
        """The text the new tokens complete; `final` flushes an unfinished character (as a
        replacement character, as a one-shot decode would)."""
        ids = list(ids)
        self.tokens += len(ids)
        return self._utf8.decode(self._token_bytes(ids), final=final)
