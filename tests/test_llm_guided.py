"""Guided decoding (structured output): the guide rules of the stock backend, xgrammar's
tokenizer info file in upstream's format, the token mask, and guided requests through the
reference repository (the shared `triton_server`), each rule broken on purpose once."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
from guided_cases import BAD_SCHEMA, PATTERN, SCHEMA

from qvl_trt.errors import ConfigError, InputError
from qvl_trt.llm.guided import (
    FORWARD_ERROR,
    NOT_SET_UP,
    Guide,
    GuidedDecoding,
    GuideError,
    GuideType,
    TokenizerInfo,
)
from qvl_trt.testing.tiny_checkpoint import VOCAB_SIZE

TOKENIZER_SIZE = 151_669  # Qwen3-VL's tokens, added ones included (below VOCAB_SIZE)
END_IDS = (151645, 151643)  # the tiny checkpoint's generation_config eos_token_id



@pytest.mark.parametrize("guide_type, guide, words", [
    ("json_schema", None, "The guide string must be provided unless using GuideType::kJSON"),
    ("regex", None, "The guide string must be provided"),
    ("xml", "<a/>", "'xml' is not one of json, json_schema, regex, ebnf_grammar"),
    ("JSON", None, "'JSON' is not one of"),  # the backend's mapping is case-sensitive
    ("", None, "'' is not one of"),
    ("structural_tag", "{}", "structural_tag is not carried by the tensorrtllm backend"),
    (None, '{"type": "object"}', "sent without guided_decoding_guide_type"),
])
def test_a_guide_the_backend_would_refuse_or_drop_is_refused(guide_type, guide, words) -> None:
    with pytest.raises(InputError, match=re.escape(words)):
        Guide.from_inputs(guide_type, guide)


def test_a_well_formed_guide_is_read() -> None:
    assert Guide.from_inputs(None, None) is None
    assert Guide.from_inputs("json", None) == Guide(GuideType.JSON)
    assert Guide.from_inputs("regex", "[0-9]+") == Guide(GuideType.REGEX, "[0-9]+")
    assert [t.value for t in GuideType] == ["json", "json_schema", "regex", "ebnf_grammar"]


@pytest.fixture(scope="module")
def info(tiny_ckpt) -> TokenizerInfo:
    return TokenizerInfo.of_tokenizer(tiny_ckpt / "tokenizer.json", END_IDS)


@pytest.fixture(scope="module")
def guided(info) -> GuidedDecoding:
    return GuidedDecoding(info, VOCAB_SIZE)


def test_the_tokenizer_info_file_is_upstreams_format(info, tmp_path) -> None:
    path = tmp_path / "info.json"
    info.write(path)
    data = json.loads(path.read_text())
    assert set(data) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    vocab = data["encoded_vocab"]
    # every token in id order, the added (special) ones included
    assert len(vocab) == TOKENIZER_SIZE
    assert vocab[9707] == "Hello" and vocab[1879] == "Ġworld"
    assert vocab[151644:151646] == ["<|im_start|>", "<|im_end|>"]
    assert data["stop_token_ids"] == list(END_IDS)
    assert json.loads(data["tokenizer_str"])["model"]["type"] == "BPE"
    assert TokenizerInfo.read(path) == info


@pytest.mark.parametrize("content, words", [
    ("{", "is not a readable JSON file"),
    ('{"encoded_vocab": ["a"], "tokenizer_str": "{}"}', "is not xgrammar's tokenizer info"),
    ('{"encoded_vocab": "a", "tokenizer_str": "{}", "stop_token_ids": [0]}',
     "is not xgrammar's tokenizer info"),
    ('{"encoded_vocab": ["a"], "tokenizer_str": "{}", "stop_token_ids": [true]}',
     "is not xgrammar's tokenizer info"),
    ('{"encoded_vocab": ["a", "b"], "tokenizer_str": "{}", "stop_token_ids": [2]}',
     "stop_token_ids [2] are not tokens of its 2-token vocabulary"),
])
def test_a_broken_tokenizer_info_file_is_refused(tmp_path, content, words) -> None:
    path = tmp_path / "info.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(words)):
        TokenizerInfo.read(path)


def test_the_mask_never_admits_a_fake_prompt_id_nor_an_id_outside_the_tokenizer(guided) -> None:
    torch = pytest.importorskip("torch")
    # `.*` admits nearly every token, and the end tokens at any point.
    for guide in (Guide(GuideType.REGEX, ".*"), Guide(GuideType.JSON),
                  Guide(GuideType.JSON_SCHEMA, json.dumps(SCHEMA))):
        matcher = guided.matcher(guide)
        matcher.fill()
        allowed = matcher.allowed()
        assert len(allowed) == VOCAB_SIZE  # one bit per logit; fake ids start past them
        admitted = np.flatnonzero(allowed)
        assert admitted.size and admitted.max() < TOKENIZER_SIZE, guide
        logits = torch.zeros(VOCAB_SIZE)
        matcher.apply(logits)
        assert torch.isinf(logits[TOKENIZER_SIZE:]).all()
        assert torch.isfinite(logits).sum() == admitted.size
    # The schema's first token is `{`: neither an end token nor a special token.
    assert set(admitted.tolist()) & {151644, *END_IDS} == set()
    # Where any text goes, the end tokens end it; the other added tokens (<|im_start|>, ...)
    # count as their literal text, as xgrammar reads upstream's file (the executor too).
    wide = set(np.flatnonzero(_mask(guided, Guide(GuideType.REGEX, ".*"))).tolist())
    assert set(END_IDS) <= wide and 151644 in wide and max(wide) == TOKENIZER_SIZE - 1


def test_a_complete_grammar_admits_only_the_end_tokens(guided, info) -> None:
    matcher = guided.matcher(Guide(GuideType.REGEX, "[0-9]"))
    matcher.fill()
    digits = np.flatnonzero(matcher.allowed())
    assert {info.encoded_vocab[t] for t in digits} == set("0123456789")
    assert matcher.accept(info.encoded_vocab.index("7"))
    matcher.fill()
    assert set(np.flatnonzero(matcher.allowed()).tolist()) == set(END_IDS)
    assert not matcher.accept(info.encoded_vocab.index("8"))  # the grammar is complete
    assert matcher.accept(END_IDS[0]) and matcher.terminated
    # Past an end token xgrammar refuses, and the executor's step fails with it.
    with pytest.raises(GuideError, match=re.escape(FORWARD_ERROR) + ".*terminated after "
                       "accepting the stop token"):
        matcher.fill()


def _mask(guided: GuidedDecoding, guide: Guide) -> np.ndarray:
    matcher = guided.matcher(guide)
    matcher.fill()
    return matcher.allowed()


@pytest.mark.parametrize("guide, words", [
    (Guide(GuideType.JSON_SCHEMA, BAD_SCHEMA),
     "the json_schema guide does not compile: properties must be an object"),
    (Guide(GuideType.JSON_SCHEMA, "not json"), "Failed to parse JSON"),
    (Guide(GuideType.REGEX, "(ab"), "the regex guide does not compile: Regex parsing error"),
    (Guide(GuideType.EBNF_GRAMMAR, "root ::= rule"), 'Rule "rule" is not defined'),
])
def test_a_guide_that_does_not_compile_fails_as_the_executor_fails_it(guided, guide,
                                                                      words) -> None:
    with pytest.raises(GuideError, match=re.escape(words)) as raised:
        guided.matcher(guide)
    assert str(raised.value).startswith(FORWARD_ERROR)
    assert "/project/cpp" not in str(raised.value)  # xgrammar's log prefix is cut
    # What preprocessing checks first, with xgrammar's parsers alone.
    with pytest.raises(GuideError, match=re.escape(words) + ".*the engine would fail every "
                       "request of its step"):
        guide.check()
    Guide(GuideType.JSON_SCHEMA, json.dumps(SCHEMA)).check()
    Guide(GuideType.JSON).check()


@pytest.mark.parametrize("guide, words", [
    (Guide(GuideType.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"not": {}}}}'),
     "the json_schema guide's properties.a.not uses 'not'"),
    (Guide(GuideType.JSON_SCHEMA, '{"type": "integer", "minimum": 5}'),
     "the json_schema guide's minimum uses 'minimum'"),
    (Guide(GuideType.REGEX, "[a-z]{3,9}"), "the regex guide repeats {3,9}"),
])
def test_preprocessing_holds_ensemble_guides_to_the_gateways_subset(guide, words) -> None:
    """What the gateway refuses in a request's schema, preprocessing refuses in a guide a
    Triton client sends (the stock executor would take it, and make its masks on its step's
    thread); the reference tensorrt_llm, as the stock backend, does not check."""
    with pytest.raises(GuideError, match=re.escape(words)):
        guide.check()
    Guide(GuideType.REGEX, PATTERN).check()


def test_guided_decoding_must_match_the_engines_vocabulary(info) -> None:
    with pytest.raises(ConfigError, match="vocab_size 1000 is below the tokenizer's 151669"):
        GuidedDecoding(info, 1000)


def test_a_guided_request_is_refused_where_guided_decoding_is_off() -> None:
    from qvl_trt.llm.reference import DecodeBatch
    from qvl_trt.llm.sampling import DecodeRequest

    request = DecodeRequest((1, 2), None, 0, guide=Guide(GuideType.JSON))
    with pytest.raises(InputError, match=re.escape(NOT_SET_UP)):
        DecodeBatch(decoder=None, guided=None).add(request)


@pytest.mark.parametrize("backend, file, words", [
    ("outlines", True, "Invalid guided_decoding_backend parameter 'outlines'"),
    ("xgrammar", False, "Xgrammar's tokenizer info path at"),
])
def test_the_reference_model_loads_guided_decoding_as_the_backend(tmp_path, info, backend,
                                                                  file, words) -> None:
    from qvl_trt.triton.contract import ReferenceLlmParameters
    from qvl_trt.triton.runtime.reference_tensorrt_llm import guided_decoding

    if file:
        info.write(tmp_path / "info.json")

    def params(backend: str, path: str) -> ReferenceLlmParameters:
        return ReferenceLlmParameters(
            device="cpu", dtype="float32", prompt_table_rows_per_request=8,
            cancellation_check_period_ms=100, guided_decoding_backend=backend,
            xgrammar_tokenizer_info_path=path)

    # Either parameter empty: off, as the backend reads them.
    assert guided_decoding(params("", "info.json"), tmp_path, VOCAB_SIZE) is None
    assert guided_decoding(params("xgrammar", ""), tmp_path, VOCAB_SIZE) is None
    with pytest.raises(ConfigError, match=re.escape(words)):
        guided_decoding(params(backend, "info.json"), tmp_path, VOCAB_SIZE)


def test_a_guided_answer_ends_with_its_grammar_and_a_bad_guide_fails_its_whole_step(
        tiny_build, tiny_ckpt, guided, info) -> None:
    """The reference decoder as the executor: a guide's compile error ends every request of
    the step it joins (executorImpl.cpp terminateActiveRequests); a guided answer ends at the
    end token once its grammar is complete. The guide compiles off the step thread, so the
    request joins a step or more after it was added (a step with nothing else to run waits
    briefly for it)."""
    torch = pytest.importorskip("torch")
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.llm.reference import ReferenceDecoder
    from qvl_trt.llm.sampling import DecodeRequest, FinishReason, SamplingParams
    from qvl_trt.manifest import BuildFolder
    from qvl_trt.mm.rope import mrope_cos_sin_table

    decoder = ReferenceDecoder.load(BuildFolder(tiny_build).llm_checkpoint)
    ids = (9707, 11, 1879, 0)  # "Hello, world!"
    positions = np.tile(np.arange(len(ids)), (3, 1))
    mrope = torch.from_numpy(mrope_cos_sin_table(
        positions, open_checkpoint(tiny_ckpt).text,
        decoder.config.max_position_embeddings).reshape(-1))

    def request(guide: Guide | None) -> DecodeRequest:
        return DecodeRequest(ids, mrope, 0, guide=guide, sampling=SamplingParams(
            max_tokens=8, greedy=True, end_id=END_IDS[0], stop_token_ids=END_IDS))

    batch = decoder.batch(guided)
    key = batch.add(request(Guide(GuideType.REGEX, "[0-9]{2}")))
    events = []
    for _ in range(2000):  # at most 100 s of compiling
        events += batch.step()
        if key not in batch:
            break
    assert len(events) == 3
    assert all(info.encoded_vocab[e.token_id].isdigit() for e in events[:2])
    assert events[2].token_id in END_IDS and events[2].finish_reason is FinishReason.STOP
    assert key not in batch

    batch = decoder.batch(guided)
    batch.add(request(None))
    batch.add(request(Guide(GuideType.REGEX, "(ab")))
    with pytest.raises(GuideError, match=re.escape(FORWARD_ERROR)):
        for _ in range(2000):  # it fails the step it joins
            batch.step()

    # A guide that compiles for long holds up its own request only: the plain one that came
    # with it gets all its tokens meanwhile (the compile is held until it has), then the
    # guided one joins. Compiled on the step thread, as the executor does, the plain request
    # would get none until the compile ended.
    release = threading.Event()
    slow = GuidedDecoding(guided.info, guided.vocab_size)
    compile_now = slow.matcher
    slow.matcher = lambda guide: (release.wait(60), compile_now(guide))[1]
    batch = decoder.batch(slow)
    plain = batch.add(request(None))
    held = batch.add(request(Guide(GuideType.REGEX, "[0-9]{2}")))
    plain_tokens = [e for _ in range(8) for e in batch.step() if e.request == plain]
    assert len(plain_tokens) == 8 and plain not in batch and held in batch
    release.set()
    held_tokens = []
    for _ in range(2000):
        held_tokens += batch.step()
        if held not in batch:
            break
    assert [e.request for e in held_tokens] == [held] * 3


# ---- through the reference repository ------------------------------------------------------

def _ask(server, *, model: str = "ensemble", **guide):
    from qvl_trt.client.generate import GenerateClient, GenerateRequest

    with GenerateClient(f"grpc://{server.grpc_url}", model=model) as client:
        return client.generate(GenerateRequest("Describe a pet.", max_tokens=48, **guide))


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_json_schema_guide_gives_json_that_validates(triton_server, model) -> None:
    """The schema as its compact grammar (what `infer --json-schema --compact` sends): nested
    objects, an enum, an array, required fields; the same request without it does not
    validate (the tiny random model's text is gibberish)."""
    jsonschema = pytest.importorskip("jsonschema")
    from qvl_trt.llm.guided import compact_json_schema

    guided = _ask(triton_server, model=model, guide_type="ebnf_grammar",
                  guide=compact_json_schema(json.dumps(SCHEMA)))
    jsonschema.validate(json.loads(guided.text), SCHEMA)
    assert guided.finish_reason == "stop"  # the grammar completed: the end token
    if model == "ensemble":
        free = _ask(triton_server).text
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(free), SCHEMA)


def test_a_json_schema_guide_is_compiled_as_the_executor_compiles_it(triton_server,
                                                                      guided) -> None:
    """json_schema guides admit any whitespace between tokens (xgrammar's any_whitespace,
    which the executor leaves on): the tiny model pads an object with it until max_tokens,
    every token admitted by the schema; where the schema leaves no room for whitespace the
    answer completes and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    padded = _ask(triton_server, guide_type="json_schema", guide=json.dumps(SCHEMA))
    assert padded.finish_reason == "length" and padded.text.startswith('{"name":')
    assert guided.matcher(Guide(GuideType.JSON_SCHEMA, json.dumps(SCHEMA))).accepts(
        padded.text)
    assert not guided.matcher(Guide(GuideType.JSON_SCHEMA, json.dumps(SCHEMA))).accepts(
        padded.text + "x")  # the check can fail
    for schema in ({"enum": ["cat", "dog"]}, {"type": "string", "maxLength": 4}):
        answer = _ask(triton_server, guide_type="json_schema", guide=json.dumps(schema))
        jsonschema.validate(json.loads(answer.text), schema)
        assert answer.finish_reason == "stop"


def test_a_regex_guide_is_matched(triton_server) -> None:
    answer = _ask(triton_server, guide_type="regex", guide=PATTERN)
    assert re.fullmatch(PATTERN, answer.text) and answer.finish_reason == "stop"


@pytest.mark.parametrize("guide, words", [
    # refused by preprocessing before anything runs
    (dict(guide_type="xml", guide="<a/>"), "'xml' is not one of json, json_schema"),
    (dict(guide_type="structural_tag", guide="{}"), "structural_tag is not carried"),
    (dict(guide_type="regex"), "The guide string must be provided"),
    (dict(guide='{"type": "object"}'), "sent without guided_decoding_guide_type"),
    (dict(guide_type="json", fixed_length=True), "a guided answer needs its end token"),
    # would fail the engine's whole step (the stand-in's own test: above)
    (dict(guide_type="json_schema", guide=BAD_SCHEMA),
     "the json_schema guide does not compile: properties must be an object; the engine would "
     "fail every request of its step with it"),
    (dict(guide_type="regex", guide="(ab"), "the regex guide does not compile"),
    # would make every other request's tokens wait on its masks, or drop a keyword
    (dict(guide_type="json_schema", guide='{"type": "string", "maxLength": 40}'),
     "the json_schema guide's maxLength is 40, above the 4"),
    (dict(guide_type="json_schema", guide='{"oneOf": [{"type": "integer"}]}'),
     "the json_schema guide's oneOf uses 'oneOf'"),
    (dict(guide_type="regex", guide="[^x]{0,400}"), "the regex guide repeats {0,400}"),
])
def test_a_bad_guide_is_refused_through_the_ensemble(triton_server, guide, words) -> None:
    from qvl_trt.errors import RequestError

    with pytest.raises(RequestError, match=re.escape(words)):
        _ask(triton_server, **guide)


def test_infer_sends_a_guide(triton_server, tmp_path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from cli_harness import run_cli

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    done = run_cli("infer", "--url", f"grpc://{triton_server.grpc_url}", "--prompt", "A pet?",
                   "--max-tokens", "48", "--json-schema", str(schema), "--compact", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    assert answer["finish_reason"] == "stop"


@pytest.mark.parametrize("options, words", [
    (dict(regex="a", any_json=True), "give at most one of --json-schema, --regex, --grammar"),
    (dict(regex="a", compact=True), "--compact applies to --json-schema"),
    (dict(json_schema="missing.json"), "cannot read missing.json"),
    (dict(json_schema="not-json"), "is not JSON"),
])
def test_a_guide_option_that_cannot_be_sent_is_refused(tmp_path, monkeypatch, options,
                                                       words) -> None:
    from qvl_trt.client.generate import guide_of

    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-json").write_text("{")
    with pytest.raises(InputError, match=re.escape(words)):
        guide_of(**options)
    assert guide_of(regex="[0-9]") == {"guide_type": "regex", "guide": "[0-9]"}
    assert guide_of(any_json=True) == {"guide_type": "json", "guide": None}
