"""The reference tensorrt_llm model is at least as strict as the stock backend: each contract
check broken on purpose, and cancellation of a batch in the worker (a fake decoder)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from qvl_trt.errors import InputError
from qvl_trt.triton import contract as c
from qvl_trt.triton.runtime.reference_tensorrt_llm import (
    LlmLimits,
    LlmRequest,
    ReferenceLlm,
    check_requested_outputs,
)

LIMITS = LlmLimits(hidden_size=8, table_dtype="float32", rows_per_request=6)


def good_inputs() -> dict[str, np.ndarray]:
    ids = np.array([1, 2, 100, 101, 3], np.int32)
    return {
        c.INPUT_IDS: ids, c.INPUT_LENGTHS: np.int32(5), c.REQUEST_OUTPUT_LEN: np.int32(4),
        c.END_ID: np.int32(0), c.PROMPT_EMBEDDING_TABLE: np.zeros((4, 8), np.float32),
        c.PROMPT_TABLE_EXTRA_IDS: np.zeros(5, np.uint64),
        c.MROPE_ROTARY_COS_SIN: np.zeros(16, np.float32),
        c.MROPE_POSITION_DELTAS: np.int64(0),
    }


def test_a_request_by_the_contract_is_read() -> None:
    r = LlmRequest.from_inputs(good_inputs(), LIMITS)
    assert r.input_ids == (1, 2, 100, 101, 3) and r.max_tokens == 4
    # The row cap is optional (parameter absent): 7 rows pass without it.
    table = {**good_inputs(), c.PROMPT_EMBEDDING_TABLE: np.zeros((7, 8), np.float32)}
    LlmRequest.from_inputs(table, LlmLimits(8, "float32"))


BROKEN = {
    "table dtype": ({c.PROMPT_EMBEDDING_TABLE: np.zeros((4, 8), np.float16)},
                    "prompt_embedding_table is float16, the model computes in float32"),
    "table width": ({c.PROMPT_EMBEDDING_TABLE: np.zeros((4, 6), np.float32)},
                    "the model's hidden_size is 8"),
    "row cap": ({c.PROMPT_EMBEDDING_TABLE: np.zeros((7, 8), np.float32)},
                "has 7 rows, the engine takes 6 per request"),
    "extra ids length": ({c.PROMPT_TABLE_EXTRA_IDS: np.zeros(4, np.uint64)},
                         "KV reuse would mix images"),
    "missing mrope table": ({c.MROPE_ROTARY_COS_SIN: None}, "mrope_rotary_cos_sin and "
                            "mrope_position_deltas are required"),
    "missing mrope delta": ({c.MROPE_POSITION_DELTAS: None}, "are required"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_contract_rule_broken_is_refused(case) -> None:
    change, message = BROKEN[case]
    inputs = {k: v for k, v in {**good_inputs(), **change}.items() if v is not None}
    with pytest.raises(InputError, match=message):
        LlmRequest.from_inputs(inputs, LIMITS)


def test_prompt_vocab_size_and_input_lengths_are_not_read() -> None:
    inputs = {**good_inputs(), c.PROMPT_VOCAB_SIZE: np.int32(999), c.INPUT_LENGTHS: np.int32(2)}
    assert LlmRequest.from_inputs(inputs, LIMITS).input_ids == (1, 2, 100, 101, 3)


def test_outputs_must_both_be_requested() -> None:
    check_requested_outputs([])  # none requested: all
    check_requested_outputs([c.OUTPUT_IDS, c.SEQUENCE_LENGTH])
    with pytest.raises(InputError, match="sequence_length tensor must be present"):
        check_requested_outputs([c.OUTPUT_IDS])
    with pytest.raises(InputError, match="output_ids tensor must be present"):
        check_requested_outputs([c.SEQUENCE_LENGTH])


# ---- cancellation in the worker -------------------------------------------------------------

@dataclass
class Event:
    request: int
    token_id: int
    finish_reason: object = None


class EndlessDecoder:
    """Token 7 for every row, forever, but rows `wanted` drops leave the batch."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []  # the rows of each step

    def stream(self, requests, *, wanted):
        active = list(range(len(requests)))
        while active:
            self.steps.append(active)
            for b in active:
                yield Event(b, 7)
            active = [b for b in active if wanted(b)]


def test_a_cancelled_request_ends_within_a_token_and_frees_the_batch(monkeypatch) -> None:
    """Two streaming requests of one batch; during the third step `a`'s Triton request is
    cancelled and a stop request names `b`: both end at their next token with an empty final
    response, and the decoder runs no further step."""
    import qvl_trt.triton.runtime.reference_tensorrt_llm as reference_llm

    pytest.importorskip("torch")
    monkeypatch.setattr(reference_llm, "_ends_with_stop", lambda tokens, words: False)
    decoder = EndlessDecoder()
    llm = ReferenceLlm(decoder, max_batch_size=2)
    got: dict[str, list] = {"a": [], "b": []}
    finals = threading.Semaphore(0)
    cancelled = threading.Event()

    def emit(name, tokens, final):
        got[name].append((list(tokens), final))
        if name == "a" and len(got["a"]) == 3:
            cancelled.set()
            llm.stop("b")
        if final:
            finals.release()

    request = LlmRequest.from_inputs({**good_inputs(), c.REQUEST_OUTPUT_LEN: np.int32(10**6),
                                      c.STREAMING: np.bool_(True)}, LIMITS)
    llm.submit(request, lambda t, f: emit("a", t, f), pytest.fail, request_id="a",
               is_cancelled=cancelled.is_set)
    llm.submit(request, lambda t, f: emit("b", t, f), pytest.fail, request_id="b")
    assert finals.acquire(timeout=60) and finals.acquire(timeout=60)
    llm.close()
    assert got["a"] == [([7], False)] * 3 + [([], True)]
    assert got["b"] == [([7], False)] * 2 + [([], True)]
    assert decoder.steps == [[0, 1]] * 3, "no step after both were cancelled"
    with pytest.raises(InputError, match="request ID is not provided"):
        llm.stop("")


def test_requests_queued_at_unload_get_a_final_error() -> None:
    pytest.importorskip("torch")
    release = threading.Event()

    class Blocking(EndlessDecoder):
        def stream(self, requests, *, wanted):
            release.wait(60)
            yield Event(0, 7, finish_reason="length")

    llm = ReferenceLlm(Blocking(), max_batch_size=1)
    errors: list[str] = []
    request = LlmRequest.from_inputs(good_inputs(), LIMITS)
    llm.submit(request, lambda t, f: None, errors.append)
    llm.submit(request, lambda t, f: pytest.fail("queued request ran"), errors.append)
    closer = threading.Thread(target=llm.close)
    closer.start()
    release.set()
    closer.join(60)
    assert errors == [reference_llm_closing()] * 2


def reference_llm_closing() -> str:
    from qvl_trt.triton.runtime.reference_tensorrt_llm import CLOSING

    return CLOSING


def test_a_decoder_bug_answers_every_request_of_its_batch_with_its_type_only(caplog) -> None:
    """The error policy of the python models (backend.error_message): a bug is logged with its
    traceback; the clients learn only its type, not its text."""
    pytest.importorskip("torch")

    class Broken(EndlessDecoder):
        def stream(self, requests, *, wanted):
            raise KeyError("internal detail")
            yield

    llm = ReferenceLlm(Broken(), max_batch_size=2, model_name="b4_tensorrt_llm")
    errors: list[str] = []
    done = threading.Semaphore(0)

    def fail(message):
        errors.append(message)
        done.release()

    request = LlmRequest.from_inputs(good_inputs(), LIMITS)
    llm.submit(request, lambda t, f: pytest.fail("a broken decoder answered"), fail)
    assert done.acquire(timeout=60)
    llm.close()
    assert errors == ["internal error in b4_tensorrt_llm: KeyError"]
    (record,) = [r for r in caplog.records if r.exc_info]
    assert "b4_tensorrt_llm" in record.getMessage() and record.exc_info[0] is KeyError
