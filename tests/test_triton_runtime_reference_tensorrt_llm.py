"""The reference tensorrt_llm model is at least as strict as the stock backend: each contract
check broken on purpose, and the worker's in-flight scheduling and cancellation (a fake
decoder: step counts, no timing)."""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from qvl_trt.errors import ConfigError, InputError
from qvl_trt.llm.guided import Guide, GuideType
from qvl_trt.triton import contract as c
from qvl_trt.triton import tensorrtllm_backend as tb
from qvl_trt.triton.runtime.reference_tensorrt_llm import (
    LlmLimits,
    LlmRequest,
    ReferenceLlm,
    StepStats,
    check_requested_outputs,
    context_phase,
)

# Sequences as long as request_output_len (int32) can ask for: the streams of the scheduling
# tests run until cancelled.
LIMITS = LlmLimits(hidden_size=8, table_dtype="float32", max_input_len=16,
                   max_seq_len=2**31 - 1, rows_per_request=6)


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
    assert r.input_ids == (1, 2, 100, 101, 3) and r.max_tokens == 4 and r.guide is None
    guided = LlmRequest.from_inputs({
        **good_inputs(), c.GUIDED_DECODING_GUIDE_TYPE: np.array([b"regex"], object),
        c.GUIDED_DECODING_GUIDE: np.array(["[0-9]é".encode()], object)}, LIMITS)
    assert guided.guide == Guide(GuideType.REGEX, "[0-9]é")
    # The row cap is optional (parameter absent): 7 rows pass without it.
    table = {**good_inputs(), c.PROMPT_EMBEDDING_TABLE: np.zeros((7, 8), np.float32)}
    LlmRequest.from_inputs(table, dataclasses.replace(LIMITS, rows_per_request=None))


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
    # The executor's checkMinTokens; the penalty kernel would mask index -1 without an end id.
    "negative min_tokens": ({c.MIN_TOKENS: np.int32(-1)}, "min_tokens = -1 must be >= 0"),
    "min_tokens without end id": ({c.MIN_TOKENS: np.int32(2), c.END_ID: np.int32(-1)},
                                  "holds back the end id, and the request has none"),
    "min_tokens, end id absent": ({c.MIN_TOKENS: np.int32(2), c.END_ID: None},
                                  "holds back the end id"),
    # Guided decoding (llm/guided.py): the backend throws on the first, drops the others.
    "guide type without guide": ({c.GUIDED_DECODING_GUIDE_TYPE: np.array([b"regex"], object)},
                                 "The guide string must be provided"),
    "unknown guide type": ({c.GUIDED_DECODING_GUIDE_TYPE: np.array([b"yaml"], object),
                            c.GUIDED_DECODING_GUIDE: np.array([b"a: 1"], object)},
                           "'yaml' is not one of json, json_schema, regex, ebnf_grammar"),
    "guide without type": ({c.GUIDED_DECODING_GUIDE: np.array([b"[0-9]"], object)},
                           "sent without guided_decoding_guide_type"),
    # stricter: past its complete grammar the executor would fail the whole step
    "guide without end id": ({c.GUIDED_DECODING_GUIDE_TYPE: np.array([b"json"], object),
                              c.END_ID: np.int32(-1)}, "a guided answer needs its end token"),
    # stricter: the stock engine would end the answer before min_tokens, or fail the step
    "guide with min_tokens": ({c.GUIDED_DECODING_GUIDE_TYPE: np.array([b"json"], object),
                               c.MIN_TOKENS: np.int32(1)}, "min_tokens with a guided answer"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_contract_rule_broken_is_refused(case) -> None:
    change, message = BROKEN[case]
    inputs = {k: v for k, v in {**good_inputs(), **change}.items() if v is not None}
    with pytest.raises(InputError, match=message):
        LlmRequest.from_inputs(inputs, LIMITS)


def test_min_tokens_and_no_end_id_reach_the_decoders_sampling() -> None:
    """min_tokens holds back the end id in the decoder (llm.sampling.choose_token); end_id -1,
    the batch manager's "none", is no stop token."""
    pytest.importorskip("torch")
    from qvl_trt.triton.runtime.reference_tensorrt_llm import _decode_request

    held = LlmRequest.from_inputs({**good_inputs(), c.MIN_TOKENS: np.int32(3)}, LIMITS)
    sampling = _decode_request(held).sampling
    assert (held.min_tokens, sampling.min_tokens, sampling.end_id) == (3, 3, 0)
    assert 0 in sampling.stop_token_ids
    free = LlmRequest.from_inputs({**good_inputs(), c.END_ID: np.int32(c.NO_END_ID)}, LIMITS)
    assert free.end_id is None and free.min_tokens == 0
    assert _decode_request(free).sampling.stop_token_ids == ()
    # A temperature below float32's normal range is greedy, as TensorRT-LLM computes it.
    tiny = LlmRequest.from_inputs({**good_inputs(), c.TEMPERATURE: np.float32(1e-40)}, LIMITS)
    assert _decode_request(tiny).sampling.is_greedy


def test_the_executors_length_rules(caplog) -> None:
    """LlmRequest::validate: a prompt above max_input_len (not at it) is refused; a prompt
    plus request_output_len above max_seq_len has its output length clipped to what fits,
    with a warning (5 + 3 = 8 fits exactly)."""
    limits = dataclasses.replace(LIMITS, max_input_len=5, max_seq_len=8)

    def read(ids: int, output_len: int) -> LlmRequest:
        return LlmRequest.from_inputs({
            **good_inputs(), c.INPUT_IDS: np.arange(1, ids + 1, dtype=np.int32),
            c.PROMPT_TABLE_EXTRA_IDS: np.zeros(ids, np.uint64),
            c.REQUEST_OUTPUT_LEN: np.int32(output_len)}, limits)

    with caplog.at_level("WARNING"):
        assert read(5, 3).max_tokens == 3
        assert not caplog.records
        assert read(5, 4).max_tokens == 3
    assert "(5 + 4) exceeds maximum sequence length (8)" in caplog.text
    with pytest.raises(InputError, match=r"Prompt length \(6\) exceeds maximum input length "
                       r"\(5\); send a shorter prompt"):
        read(6, 1)


MALFORMED_STOP_LISTS = {
    "rank": (np.array([5, 6, 2, -1], np.int32), "shape [4]; send [2, L]"),
    "first dim": (np.array([[5, 6], [2, -1], [0, 0]], np.int32), "shape [3, 2]"),
    "past the ids": (np.array([[5, 6], [3, -1]], np.int32), "offset 3 is past its 2 token ids"),
    "not increasing": (np.array([[5, 6, 7], [2, 2, -1]], np.int32), "[2, 2, -1] do not increase"),
    "decreasing": (np.array([[5, 6, 7], [2, 1, -1]], np.int32), "[2, 1, -1] do not increase"),
    "empty first": (np.array([[5, 6], [0, 2]], np.int32), "[0, 2] do not increase"),
    "after padding": (np.array([[5, 6, 7], [1, -1, 3]], np.int32),
                      "[1, -1, 3] go on after the -1 padding"),
}


@pytest.mark.parametrize("case", list(MALFORMED_STOP_LISTS))
def test_a_malformed_stop_words_list_is_refused(case) -> None:
    words, message = MALFORMED_STOP_LISTS[case]
    with pytest.raises(InputError, match=re.escape(message)):
        LlmRequest.from_inputs({**good_inputs(), c.STOP_WORDS_LIST: words}, LIMITS)


def test_a_well_formed_stop_words_list_is_read() -> None:
    """Offsets up to the last id, -1 padding after the last word, ids past the last offset
    are padding (the stock backend reads them the same way)."""
    words = np.array([[5, 6, 7, 0], [2, 3, -1, -1]], np.int32)
    read = LlmRequest.from_inputs({**good_inputs(), c.STOP_WORDS_LIST: words}, LIMITS)
    assert read.stop_words == ((5, 6), (7,))


def test_top_k_above_the_sampling_layers_limit_is_clipped(caplog) -> None:
    """TensorRT-LLM clips top_k to TOP_K_MAX with a warning; the decoder's request gets 1024."""
    pytest.importorskip("torch")
    from qvl_trt.llm.sampling import TOP_K_MAX
    from qvl_trt.triton.runtime.reference_tensorrt_llm import _decode_request

    request = LlmRequest.from_inputs({**good_inputs(), c.RUNTIME_TOP_K: np.int32(5000)}, LIMITS)
    with caplog.at_level("WARNING"):
        assert _decode_request(request).sampling.top_k == TOP_K_MAX == 1024
    assert "top_k 5000 is larger than the 1024" in caplog.text


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


# ---- scheduling and cancellation in the worker ----------------------------------------------

@dataclass
class Event:
    request: int
    token_id: int
    finish_reason: object = None


class FakeDecoder:
    """Token 7 for every request of the batch at each step until its max_tokens; records the
    keys of each step. Its batch is made once `go` is set, so requests submitted before are
    all waiting at the first admission."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.go = threading.Event()

    def batch(self, guided=None, *, context_chunk=None):
        assert self.go.wait(60)
        return FakeBatch(self)


class FakeBatch:
    def __init__(self, decoder: FakeDecoder) -> None:
        self.decoder = decoder
        self.left: dict[int, int] = {}  # key -> tokens left
        self.keys = iter(range(10**6))

    def __len__(self) -> int:
        return len(self.left)

    def __contains__(self, key: int) -> bool:
        return key in self.left

    def add(self, request) -> int:
        if request.sampling.max_tokens == 13:
            raise InputError("13 is refused")
        key = next(self.keys)
        self.left[key] = request.sampling.max_tokens
        return key

    def drop(self, key: int) -> None:
        del self.left[key]

    def step(self) -> list[Event]:
        self.decoder.steps.append(list(self.left))
        events = []
        for key in list(self.left):
            self.left[key] -= 1
            events.append(Event(key, 7, "length" if not self.left[key] else None))
            if not self.left[key]:
                del self.left[key]
        return events


def streaming(max_tokens: int) -> LlmRequest:
    return LlmRequest.from_inputs({**good_inputs(), c.REQUEST_OUTPUT_LEN: np.int32(max_tokens),
                                   c.STREAMING: np.bool_(True)}, LIMITS)


@pytest.fixture
def no_stop_words(monkeypatch):
    import qvl_trt.triton.runtime.reference_tensorrt_llm as reference_llm

    pytest.importorskip("torch")
    monkeypatch.setattr(reference_llm, "_ends_with_stop", lambda tokens, words: False)


def test_an_end_id_ends_the_answer_and_end_id_minus_1_never_does(no_stop_words) -> None:
    """The fake decoder makes token 7 each step: with end_id 7 the first token ends the answer
    (the end token left out); with end_id -1 (no end id, ignore_eos) it runs to max_tokens."""
    decoder = FakeDecoder()
    llm = ReferenceLlm(decoder, max_batch_size=2)
    done: dict[int, list] = {}
    finals = threading.Semaphore(0)

    def submit(end_id: int) -> None:
        request = LlmRequest.from_inputs({**good_inputs(), c.REQUEST_OUTPUT_LEN: np.int32(5),
                                          c.END_ID: np.int32(end_id)}, LIMITS)
        llm.submit(request, lambda t, f: (done.setdefault(end_id, []).extend(t),
                                          f and finals.release()), pytest.fail)

    submit(7)
    submit(c.NO_END_ID)
    decoder.go.set()
    for _ in range(2):
        assert finals.acquire(timeout=60)
    llm.close()
    assert done == {7: [], c.NO_END_ID: [7] * 5}


def test_in_flight_batching_admits_at_the_next_step_and_frees_a_cancelled_slot(
        no_stop_words) -> None:
    """max_batch_size 2. A long stream runs alone; B and C arrive during its step 2: B joins
    at step 3, C waits for a slot and joins the step after B finished. When C finishes, A is
    cancelled and D arrives: the next step runs D alone (A's slot is free at once)."""
    decoder = FakeDecoder()
    llm = ReferenceLlm(decoder, max_batch_size=2)
    got: dict[str, list] = {name: [] for name in "abcd"}
    finals = threading.Semaphore(0)
    cancelled = threading.Event()

    def emit(name, tokens, final):
        got[name].append((list(tokens), final))
        if name == "a" and len(got["a"]) == 2:
            submit("b", 3)
            submit("c", 2)
        if name == "c" and final:
            cancelled.set()
            submit("d", 1)
        if final:
            finals.release()

    def submit(name, max_tokens, **kwargs):
        llm.submit(streaming(max_tokens), lambda t, f: emit(name, t, f), pytest.fail,
                   request_id=name, **kwargs)

    submit("a", 10**6, is_cancelled=cancelled.is_set)
    decoder.go.set()
    for _ in "abcd":
        assert finals.acquire(timeout=60)
    llm.close()
    a, b, c_, d = 0, 1, 2, 3
    assert decoder.steps == [[a], [a], [a, b], [a, b], [a, b], [a, c_], [a, c_], [d]]
    assert got["a"] == [([7], False)] * 7 + [([], True)]
    assert got["b"] == [([7], False)] * 2 + [([7], True)]
    assert got["d"] == [([7], True)]


def test_a_cancelled_request_ends_within_a_token_and_frees_the_batch(no_stop_words) -> None:
    """Two streaming requests of one batch; during the third step `a`'s Triton request is
    cancelled and a stop request names `b`: both end at their next token with an empty final
    response, and the decoder runs no further step."""
    decoder = FakeDecoder()
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

    llm.submit(streaming(10**6), lambda t, f: emit("a", t, f), pytest.fail, request_id="a",
               is_cancelled=cancelled.is_set)
    llm.submit(streaming(10**6), lambda t, f: emit("b", t, f), pytest.fail, request_id="b")
    decoder.go.set()
    assert finals.acquire(timeout=60) and finals.acquire(timeout=60)
    llm.close()
    assert got["a"] == [([7], False)] * 3 + [([], True)]
    assert got["b"] == [([7], False)] * 2 + [([], True)]
    assert decoder.steps == [[0, 1]] * 3, "no step after both were cancelled"
    with pytest.raises(InputError, match="request ID is not provided"):
        llm.stop("")


def test_the_cancel_flag_is_polled_at_its_period_and_a_stop_request_counts_at_once(
        no_stop_words) -> None:
    """With the stock backend's polling period (here longer than the test), a request's own
    cancel flag (a round trip to Triton in the served model) is asked once, not at every step;
    a stop request still ends its request at the next token."""
    decoder = FakeDecoder()
    llm = ReferenceLlm(decoder, max_batch_size=1, cancel_check_s=600)
    asked = []
    got: list = []
    final = threading.Event()

    def emit(tokens, is_final):
        got.append((list(tokens), is_final))
        if len(got) == 5:
            llm.stop("a")
        if is_final:
            final.set()

    llm.submit(streaming(10**6), emit, pytest.fail, request_id="a",
               is_cancelled=lambda: asked.append(1) or False)
    decoder.go.set()
    assert final.wait(60)
    llm.close()
    assert got == [([7], False)] * 5 + [([], True)]
    assert len(asked) == 1, f"the cancel flag was asked {len(asked)} times in 6 steps"


def test_a_refused_request_fails_alone(no_stop_words) -> None:
    """The decoder refuses one request of two waiting together: only that one fails, with
    the decoder's message; the other runs."""
    decoder = FakeDecoder()
    llm = ReferenceLlm(decoder, max_batch_size=2)
    errors: list[str] = []
    done = threading.Semaphore(0)

    def fail(message):
        errors.append(message)
        done.release()

    llm.submit(streaming(13), pytest.fail, fail)
    llm.submit(streaming(2), lambda t, f: f and done.release(), pytest.fail)
    decoder.go.set()
    assert done.acquire(timeout=60) and done.acquire(timeout=60)
    llm.close()
    assert errors == ["13 is refused"]
    assert decoder.steps == [[0], [0]]


def test_requests_queued_at_unload_get_a_final_error() -> None:
    pytest.importorskip("torch")
    release = threading.Event()

    class Blocking(FakeBatch):
        def step(self):
            release.wait(60)
            return [Event(0, 7, finish_reason="length")]

    class BlockingDecoder(FakeDecoder):
        def batch(self, guided=None, *, context_chunk=None):
            return Blocking(self)

    llm = ReferenceLlm(BlockingDecoder(), max_batch_size=1)
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
    traceback; the clients learn only its type, not its text. The worker keeps serving."""
    pytest.importorskip("torch")

    class Broken(FakeBatch):
        def step(self):
            if self.decoder.steps:
                return super().step()
            self.decoder.steps.append("broken")
            raise KeyError("internal detail")

    class BrokenDecoder(FakeDecoder):
        def batch(self, guided=None, *, context_chunk=None):
            return Broken(self)

    llm = ReferenceLlm(BrokenDecoder(), max_batch_size=2, model_name="b4_tensorrt_llm")
    errors: list[str] = []
    done = threading.Semaphore(0)

    def fail(message):
        errors.append(message)
        done.release()

    request = LlmRequest.from_inputs(good_inputs(), LIMITS)
    llm.submit(request, lambda t, f: pytest.fail("a broken decoder answered"), fail)
    assert done.acquire(timeout=60)
    llm.submit(request, lambda t, f: f and done.release(), pytest.fail)
    assert done.acquire(timeout=60)
    llm.close()
    assert errors == ["internal error in b4_tensorrt_llm: KeyError"]
    (record,) = [r for r in caplog.records if r.exc_info]
    assert "b4_tensorrt_llm" in record.getMessage() and record.exc_info[0] is KeyError


def test_each_iteration_and_each_end_are_reported_as_the_executor_counts_them(
        no_stop_words) -> None:
    """The stock backend's metrics come from these (ExecutorMetrics): per iteration its
    number, the requests in the batch and those in their context step with their prompt
    tokens, the positions each holds in the KV cache; per request its prompt and output tokens, at its final response."""
    decoder = FakeDecoder()
    steps: list[StepStats] = []
    ends: list[tuple[int, int]] = []
    llm = ReferenceLlm(decoder, max_batch_size=2, on_step=steps.append,
                       on_finish=lambda prompt, out: ends.append((prompt, out)))
    finals = threading.Semaphore(0)
    for tokens in (2, 3):
        request = LlmRequest.from_inputs({**good_inputs(), c.REQUEST_OUTPUT_LEN:
                                          np.int32(tokens), c.END_ID: np.int32(c.NO_END_ID)},
                                         LIMITS)
        llm.submit(request, lambda t, final: final and finals.release(), pytest.fail)
    decoder.go.set()
    for _ in range(2):
        assert finals.acquire(timeout=60)
    llm.close()
    assert steps == [StepStats(1, 2, 2, 10, (5, 5)), StepStats(2, 2, 0, 0, (6, 6)),
                     StepStats(3, 1, 0, 0, (7,))]
    assert sorted(ends) == [(5, 2), (5, 3)]


ENGINE = tb.EngineLimits(max_seq_len=64, max_num_tokens=20, tokens_per_block=8,
                         paged_context_fmha=True)


def test_the_longest_prompt_and_the_chunk_follow_the_engine_and_enable_chunked_context(
        caplog) -> None:
    """As the executor: with chunked context the longest prompt is max_seq_len - 1 and a
    context runs in chunks of max_num_tokens cut to whole blocks; without, it is
    min(max_seq_len - 1, max_num_tokens) in one pass; on an engine without paged context
    FMHA chunking is turned off with the executor's warning."""
    assert context_phase(ENGINE, True, 64, "m") == (63, 16)
    assert context_phase(ENGINE, False, 64, "m") == (20, None)
    unpaged = dataclasses.replace(ENGINE, paged_context_fmha=False)
    assert context_phase(unpaged, True, 64, "m") == (20, None)
    assert tb.CHUNKING_DISABLED in caplog.text
    with pytest.raises(ConfigError, match="max_num_tokens 4 is below one KV block"):
        context_phase(dataclasses.replace(ENGINE, max_num_tokens=4), True, 64, "m")
    context_phase(dataclasses.replace(ENGINE, max_num_tokens=4), False, 64, "m")
    with pytest.raises(ConfigError, match="max_seq_len 64 is not the checkpoint's "
                                          "max_position_embeddings 128"):
        context_phase(ENGINE, True, 128, "m")


def test_enable_chunked_context_is_read_as_the_backend_reads_it() -> None:
    """Absent: false; the backend's spellings of a bool; one it cannot read is refused
    (the backend would silently run without chunked context)."""
    params = {"device": "cpu", "dtype": "float32", "prompt_table_rows_per_request": "8",
              "cancellation_check_period_ms": "100"}
    read = c.ReferenceLlmParameters.from_parameters
    assert read(params).enable_chunked_context is False
    assert [read({**params, "enable_chunked_context": text}).enable_chunked_context
            for text in ("True", "1", "false", "FALSE")] == [True, True, False, False]
    with pytest.raises(ConfigError, match=r"enable_chunked_context: Cannot convert 'yes' to a "
                                          "boolean"):
        read({**params, "enable_chunked_context": "yes"})
