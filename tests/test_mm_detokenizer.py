"""Incremental detokenization (qvl_trt/mm/detokenizer.py): streamed deltas add up to the one-shot decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_ckpt: Path) -> Path:
    return tiny_ckpt


def test_streamed_deltas_concatenate_to_the_one_shot_decode(tokenizer_dir: Path) -> None:
    """Token by token, including characters split over byte tokens, invalid byte runs,
    special tokens and ids beyond the vocabulary: the deltas add up to HF's decode."""
    tokenizers = pytest.importorskip("tokenizers")
    from qvl_trt.mm.detokenizer import StreamDecoder, TokenBytes

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    table = TokenBytes.from_tokenizer_json(tokenizer_dir / "tokenizer.json")
    rng = random.Random(0)
    text = "Größe 你好，世界 🙂🦜 <think>x</think>"
    split = tok.encode(text).ids
    assert len(split) > len(text.split()), "expected characters split over several tokens"
    cases = [split, split + [151645], [rng.randrange(151_936) for _ in range(40)]]
    cases += [[rng.randrange(151_936) for _ in range(rng.randrange(1, 20))] for _ in range(200)]
    for ids in cases:
        stream = StreamDecoder(table)
        deltas = [stream.push([t]) for t in ids] + [stream.push([], final=True)]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert stream.tokens == len(ids)
    # A split character shows nowhere half-done: no delta holds a replacement character.
    stream = StreamDecoder(table)
    assert all("\ufffd" not in stream.push([t]) for t in split)


def test_tokenizers_decode_stream_is_never_ahead_and_keeps_a_split_tail(
        tokenizer_dir: Path) -> None:
    """Against the tokenizers library's own incremental decoder (DecodeStream), over random
    streams rich in byte tokens (lone bytes >= 0x80 and tokens that are not whole UTF-8),
    added tokens and ids beyond the vocabulary, pushed 1-3 ids at a time: after every push
    DecodeStream's text is a prefix of ours, and ours adds up to the one-shot decode.
    DecodeStream has no flush, so a stream ending inside a character never gets its
    replacement character; and it holds back a lone continuation byte or a literal U+FFFD
    until a later token, where StreamDecoder emits it at once."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.decoders import DecodeStream

    from qvl_trt.mm.detokenizer import StreamDecoder, TokenBytes, byte_to_unicode

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    table = TokenBytes.from_tokenizer_json(tokenizer_dir / "tokenizer.json")
    vocab, to_char = tok.get_vocab(), byte_to_unicode()
    lone_bytes = [vocab[to_char[b]] for b in range(0x80, 0x100)]
    partial = [i for i in range(tok.get_vocab_size()) if _not_utf8(table([i]))]
    assert len(partial) > 1000, "expected many tokens that are pieces of characters"
    added = list(tok.get_added_tokens_decoder())  # special ones and <think>-like text ones
    rng = random.Random(1)

    def draw() -> int:
        r = rng.random()
        return (rng.choice(lone_bytes) if r < 0.35 else rng.choice(partial) if r < 0.6
                else rng.choice(added) if r < 0.65 else rng.randrange(151_936))

    held_tail = held_midway = 0
    for _ in range(1500):
        ids = [draw() for _ in range(rng.randrange(1, 40))]
        ours, theirs = StreamDecoder(table), DecodeStream(skip_special_tokens=True)
        ours_text = theirs_text = ""
        i = 0
        while i < len(ids):
            chunk = ids[i:i + rng.randrange(1, 4)]
            i += len(chunk)
            ours_text += ours.push(chunk)
            theirs_text += theirs.step(tok, chunk) or ""
            assert ours_text.startswith(theirs_text), (ids, ours_text, theirs_text)
            held_midway += i < len(ids) and ours_text != theirs_text
        ours_text += ours.push([], final=True)
        assert ours_text == tok.decode(ids, skip_special_tokens=True)
        held_tail += ours_text != theirs_text
    print(f"DecodeStream held back text after {held_midway} pushes and never gave the tail "
          f"of {held_tail} of 1500 streams")
    assert held_tail > 0


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
