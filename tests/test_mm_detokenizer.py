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
