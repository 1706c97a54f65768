"""The pipeline benchmark's token generator behind the reference tensorrt_llm model: the
reference model's responses, end, cancellation and stop (no timing asserted)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.llm.sampling import DecodeRequest, SamplingParams
from qvl_trt.testing.token_generator import SETTINGS, TokenGenerator, install_token_generator
from qvl_trt.triton import contract as c
from qvl_trt.triton.runtime.reference_tensorrt_llm import LlmLimits, LlmRequest, ReferenceLlm

VOCAB = 100
CONFIG = SimpleNamespace(vocab_size=VOCAB, hidden_size=8)
# Sequences as long as request_output_len (int32) can ask for: the streams here run until
# cancelled.
LIMITS = LlmLimits(hidden_size=8, table_dtype="float32", max_input_len=16,
                   max_seq_len=2**31 - 1)


def request(max_tokens: int, ids=(5, 6, 0, VOCAB + 3)) -> LlmRequest:
    return LlmRequest.from_inputs({
        c.INPUT_IDS: np.array(ids, np.int32), c.REQUEST_OUTPUT_LEN: np.int32(max_tokens),
        c.END_ID: np.int32(0), c.STREAMING: np.bool_(True),
        c.MROPE_ROTARY_COS_SIN: np.zeros(16, np.float32),
        c.MROPE_POSITION_DELTAS: np.int64(0)}, LIMITS)


def run(llm: ReferenceLlm, max_tokens: int, on_token=lambda n: None,
        **kwargs) -> tuple[list, list]:
    got, errors, done = [], [], threading.Event()

    def emit(tokens, final):
        got.append((list(tokens), final))
        on_token(len(got))
        if final:
            done.set()

    def fail(message):
        errors.append(message)
        done.set()

    llm.submit(request(max_tokens), emit, fail, **kwargs)
    assert done.wait(timeout=60)
    return got, errors


@pytest.fixture
def llm():
    pytest.importorskip("torch")  # the reference model's request conversion
    llm = ReferenceLlm(TokenGenerator(CONFIG, tokens_per_s=1e6), max_batch_size=4)
    yield llm
    llm.close()


def test_it_streams_the_prompt_text_ids_one_response_per_token(llm) -> None:
    """The end id (0) and the fake visual id are never emitted; the last token comes in the
    final response, as the reference model's."""
    got, errors = run(llm, 5)
    assert not errors
    assert got == [([5], False), ([6], False), ([5], False), ([6], False), ([5], True)]


def test_a_cancelled_or_stopped_request_ends_with_an_empty_final_response(llm) -> None:
    cancelled = threading.Event()
    calls = []

    def is_cancelled():
        calls.append(1)
        if len(calls) == 3:
            cancelled.set()
        return cancelled.is_set()

    got, _ = run(llm, 10**6, is_cancelled=is_cancelled)
    assert got[-1] == ([], True) and len(got) < 10

    # The stock backend's stop request names it by id.
    got, _ = run(llm, 10**9, request_id="r", on_token=lambda n: n == 3 and llm.stop("r"))
    assert got == [([5], False), ([6], False), ([5], False), ([], True)]


def test_a_prompt_without_text_ids_is_refused(llm) -> None:
    got, errors = [], []
    done = threading.Event()
    llm.submit(LlmRequest.from_inputs({
        c.INPUT_IDS: np.array([0, VOCAB + 1], np.int32), c.REQUEST_OUTPUT_LEN: np.int32(2),
        c.END_ID: np.int32(0), c.MROPE_ROTARY_COS_SIN: np.zeros(16, np.float32),
        c.MROPE_POSITION_DELTAS: np.int64(0)}, LIMITS),
        lambda t, f: got.append(t), lambda m: (errors.append(m), done.set()))
    assert done.wait(timeout=60)
    assert not got and "send a prompt with text" in errors[0]


def test_the_batch_drops_and_finishes_requests() -> None:
    batch = TokenGenerator(CONFIG, tokens_per_s=1e6).batch()
    a = batch.add(DecodeRequest((1, 2), None, 0, sampling=SamplingParams(max_tokens=2)))
    b = batch.add(DecodeRequest((3,), None, 0, sampling=SamplingParams(max_tokens=5)))
    assert [(e.request, e.token_id) for e in batch.step()] == [(a, 1), (b, 3)]
    batch.drop(b)
    (last,) = batch.step()
    assert last.token_id == 2 and last.finish_reason is not None and len(batch) == 0
    with pytest.raises(KeyError):
        batch.drop(b)


def test_a_rate_below_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="give a rate > 0"):
        TokenGenerator(CONFIG, tokens_per_s=0)


def test_install_replaces_the_model_and_drops_the_weights(tmp_path) -> None:
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "rank0.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "model.py").write_text("stock")
    install_token_generator(tmp_path, 250)
    assert "TokenGenerator.load(HERE)" in (tmp_path / "model.py").read_text()
    assert (tmp_path / SETTINGS).read_text() == '{"tokens_per_s": 250}'
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["config.json"]
    compile((tmp_path / "model.py").read_text(), "model.py", "exec")

