"""The tensor contract's codecs (qvl_trt/triton/contract.py)."""

from __future__ import annotations

from qvl_trt.triton.contract import stop_words_list, word_list_sequences


def test_word_lists_round_trip() -> None:

    assert stop_words_list([]).tolist() == [[0], [-1]]
    words = [[5, 6], [7], [8, 9, 10]]
    table = stop_words_list(words)
    assert table.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]]
    assert word_list_sequences(table) == words
    assert word_list_sequences(stop_words_list([])) == []
