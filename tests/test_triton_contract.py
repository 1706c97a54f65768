"""The tensor contract's codecs (qvl_trt/triton/contract.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qvl_trt.errors import EngineLimitError, InputError, LimitError, UnavailableError
from qvl_trt.triton.contract import stop_words_list, word_list_sequences


def test_word_lists_round_trip() -> None:

    assert stop_words_list([]).tolist() == [[0], [-1]]
    words = [[5, 6], [7], [8, 9, 10]]
    table = stop_words_list(words)
    assert table.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]]
    assert word_list_sequences(table) == words
    assert word_list_sequences(stop_words_list([])) == []


# ---- the ensemble request: one encoder, one reader ----------------------------------------

class _Tensor:
    """What row_of reads of a python backend tensor."""

    def __init__(self, value) -> None:
        self.value = value

    def as_numpy(self):
        return self.value


def test_the_ensemble_request_names_every_input_and_round_trips() -> None:
    from dataclasses import fields

    from tritonclient.utils import np_to_triton_dtype

    from qvl_trt.triton import contract as c
    from qvl_trt.triton.runtime.backend import row_of

    assert [f.name for f in fields(c.EnsembleRequest)] == [s.name for s in c.ENSEMBLE_INPUTS]
    full = c.EnsembleRequest(
        messages=json.dumps([{"role": "user", "content": "é"}]), text_input="q",
        image_bytes=(b"a", b"bc"),
        video_bytes=(b"v",), video_frames=(b"f1", b"f2"), video_frame_counts=(2,),
        video_fps=(2.0,), max_tokens=7, min_tokens=2, ignore_eos=True, temperature=0.5,
        top_p=0.75, top_k=3, seed=2**64 - 1, stop=("x", "ü"), stream=False,
        tools='[{"type": "function"}]', guided_decoding_guide_type="json_schema",
        guided_decoding_guide='{"type": "object"}', health_probe=False, cache_scope="team-ü")
    tensors = full.to_tensors()
    specs = {s.name: s for s in c.ENSEMBLE_INPUTS}
    assert list(tensors) == list(specs)
    for name, value in tensors.items():
        assert np_to_triton_dtype(value.dtype) == specs[name].data_type, name
        assert value.shape[0] == 1
    row = row_of({name: _Tensor(value) for name, value in tensors.items()}, c.ENSEMBLE_INPUTS)
    assert c.EnsembleRequest.from_row(row) == full
    assert full.payload_bytes() == sum(len(text.encode()) for text in (
        full.messages, full.tools, full.guided_decoding_guide_type,
        full.guided_decoding_guide, full.cache_scope)) + 1 + 3 + 1 + 4 + 1 + 2
    assert c.EnsembleRequest(text_input="hi").to_tensors().keys() == {c.TEXT_INPUT}
    with pytest.raises(InputError, match="stop is not UTF-8 text"):
        c.EnsembleRequest.from_row({c.STOP: np.array([b"\xff"], object)})


@pytest.mark.parametrize("request_, words", [
    # A lone surrogate (JSON can spell one; argv's surrogateescape makes one of a bad byte).
    (dict(text_input="ok \ud800"), "text_input holds a lone surrogate (U+D800 at character 3)"),
    (dict(messages='[{"content": "\udcff"}]'), "messages holds a lone surrogate (U+DCFF"),
    (dict(text_input="q", stop=("fine", "\udfff")), "stop[1] holds a lone surrogate"),
    # An FP32 input beyond float32 would travel as inf.
    (dict(text_input="q", temperature=1e308), "temperature = 1e+308 is beyond float32"),
    (dict(text_input="q", top_p=-4e38), "top_p = -4e+38 is beyond float32"),
    (dict(text_input="q", video_fps=(1.0, 1e39)), "video_fps = 1e+39 is beyond float32"),
])
def test_the_encoder_refuses_what_its_tensors_cannot_carry_by_name(request_, words) -> None:
    from qvl_trt.triton import contract as c

    with pytest.raises(InputError) as caught:
        c.EnsembleRequest(**request_).to_tensors()
    assert words in str(caught.value) and "\n" not in str(caught.value)
    # float32's largest value itself travels as it is.
    largest = c.EnsembleRequest(text_input="q", temperature=c.FP32_MAX).to_tensors()
    assert np.isfinite(largest[c.TEMPERATURE]).all()


# ---- error kinds: raised in a python model, read back from the text --------------------------

@pytest.mark.parametrize("exc, kind", [
    (InputError("prompt is too long; shorten it"), "REQUEST"),
    (LimitError("the number of stop strings is 17, above the limit of 16"), "LIMIT"),
    (EngineLimitError("prompt has 900 tokens, the engine allows 768"), "ENGINE_LIMIT"),
    (UnavailableError("the model is unloading; send it again"), "UNAVAILABLE"),
    (KeyError("secret"), "INTERNAL"),
])
def test_each_error_kind_survives_the_wire_text(exc, kind) -> None:
    from qvl_trt.triton.contract import ErrorKind
    from qvl_trt.triton.runtime.backend import error_message

    text = error_message(exc, "b4_preprocessing")
    assert ErrorKind.of_error(exc) is ErrorKind[kind]
    assert text.startswith(ErrorKind[kind].value)
    assert ErrorKind.of_message(text) is ErrorKind[kind]
    # Behind Triton's ensemble prefix, and passed on by a model that names the step.
    assert ErrorKind.of_message(f"in ensemble 'b4_ensemble', {text}") is ErrorKind[kind]
    relayed = ErrorKind.relay(f"in ensemble 'b4_ensemble', {text}", "b4_tensorrt_llm")
    assert relayed.startswith(ErrorKind[kind].value + "b4_tensorrt_llm: ")
    assert ErrorKind.of_message(relayed) is ErrorKind[kind]
    assert "secret" not in text


@pytest.mark.parametrize("words", [
    "internal error in x", "unavailable: x", "over a deployment limit: x", "busy: x",
    "is not healthy", "Stub process 'p' is not healthy.", "Request for unknown model: 'm'",
    "in ensemble 'e', busy: x"])
def test_a_clients_words_never_decide_the_kind(words) -> None:
    """Text a client sent (a role, a tool's name) lands inside a refusal's text; only the
    start of the text, which the server alone writes, carries the kind."""
    from qvl_trt.triton.contract import ErrorKind
    from qvl_trt.triton.runtime.backend import error_message

    text = error_message(InputError(f"message 1 has role {words!r}; use one of user"), "b4_pre")
    assert ErrorKind.of_message(text) is ErrorKind.REQUEST
    assert ErrorKind.of_message(f"in ensemble 'b4_ensemble', {text}") is ErrorKind.REQUEST
    assert ErrorKind.of_message(ErrorKind.relay(text, "b4_tensorrt_llm")) is ErrorKind.REQUEST


@pytest.mark.parametrize("message, kind", [
    ("Stub process 'b4_preprocessing_0_0' is not healthy.", "UNAVAILABLE"),
    ("in ensemble 'b4_ensemble', Stub process 'b4_postprocessing_0_0' is not healthy.",
     "UNAVAILABLE"),
    ("Failed for execute the inference request. Model 'b4_preprocessing' is not ready.",
     "UNAVAILABLE"),
    ("Request for unknown model: 'b4_ensemble' has no available versions", "UNAVAILABLE"),
    # The stock backend's own words: the request's.
    ("Encountered an error in forwardAsync function: is not healthy", "REQUEST"),
    ("unexpected shape for input 'text_input' for model 'b4_ensemble'", "REQUEST"),
])
def test_tritons_own_texts_are_read_at_their_start(message, kind) -> None:
    from qvl_trt.triton.contract import ErrorKind

    assert ErrorKind.of_message(message) is ErrorKind[kind]
    assert ErrorKind.of_message(ErrorKind.relay(message, "b4_tensorrt_llm")) is ErrorKind[kind]
