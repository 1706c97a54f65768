"""The reference decoder on converted checkpoints against Hugging Face Qwen3-VL (fp32, tiny):
prompt logits, every decode step's logits and greedy tokens, for text only, one image and two
images of different sizes, TP 1 and TP 2. The inputs are the engine's: fake ids, the (1+K)
row prompt table and the MRoPE table + delta made by qvl_trt.mm. Corrupting the layout on
purpose must make the same check fail."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from qvl_trt.chat_messages import user_message
from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import CheckpointError, InputError
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.reference import ReferenceDecoder
from qvl_trt.llm.sampling import (
    TOP_K_MAX,
    DecodeRequest,
    DecodeResult,
    FinishReason,
    SamplingParams,
    TokenEvent,
    choose_token,
)
from qvl_trt.mm.prompt_table import assemble_prompt_table
from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
from qvl_trt.mm.rope import mrope_cos_sin_table

TOLERANCE = 1e-4  # max abs logit difference, fp32
MAX_POSITIONS = 1024
GREEDY_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt as HF takes it and as the engine takes it."""

    hf_inputs: dict
    request: DecodeRequest


@pytest.fixture(scope="module")
def hf_model(tiny_hf_model):
    return tiny_hf_model


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("reference")
    return {tp: convert_checkpoint(tiny_ckpt, root / f"tp{tp}", max_seq_len=MAX_POSITIONS,
                                   dtype="float32", tp_size=tp).out for tp in (1, 2)}


@pytest.fixture(scope="module")
def decoders(converted) -> dict[int, ReferenceDecoder]:
    return {tp: ReferenceDecoder.load(path) for tp, path in converted.items()}


@pytest.fixture(scope="module")
def preprocessor(tiny_ckpt: Path) -> RequestPreprocessor:
    ckpt = open_checkpoint(tiny_ckpt)
    limits = dataclasses.replace(RequestLimits.of_checkpoint(ckpt), max_seq_len=MAX_POSITIONS,
                                 max_input_len=MAX_POSITIONS - GREEDY_TOKENS)
    return RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)


def _image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


IMAGES = {"text": [], "one_image": [_image(100, 150, 1)],
          "two_images": [_image(100, 150, 1), _image(300, 420, 2)]}


def make_case(preprocessor: RequestPreprocessor, hf_model, images: list[Image.Image], *,
              interleaved: bool = True, drop_deepstack: bool = False,
              sampling: SamplingParams | None = None) -> Case:
    """Tensors from qvl_trt.mm, vision features from the HF tower (this checks the LLM path)."""
    ckpt = preprocessor.checkpoint
    prepared = preprocessor.prepare(messages=user_message("Describe this.", len(images)),
                                    images=images)
    tensors = prepared.tensors()
    ids = torch.from_numpy(prepared.input_ids.astype(np.int64))[None]
    hf_inputs = {"input_ids": ids}
    table = None
    if images:
        # The float pixels HF's processor makes (ours are the 8-bit ones).
        pixel_values = torch.from_numpy(preprocessor.pixels.normalise(tensors["pixel_values"]))
        grid = torch.from_numpy(tensors["image_grid_thw"])
        hf_inputs.update(pixel_values=pixel_values, image_grid_thw=grid)
        # Newer transformers find the images of the rope index through mm_token_type_ids.
        if "mm_token_type_ids" in inspect.signature(hf_model.model.get_rope_index).parameters:
            hf_inputs["mm_token_type_ids"] = (ids == ckpt.token_ids.image).int()
        with torch.no_grad():
            out = hf_model.model.visual(pixel_values.to(hf_model.device, hf_model.dtype),
                                        grid_thw=grid.to(hf_model.device), return_dict=True)
        deepstack = [f.float().cpu().numpy() for f in out.deepstack_features]
        if drop_deepstack:
            deepstack = [np.zeros_like(f) for f in deepstack]
        table = assemble_prompt_table(out.pooler_output.float().cpu().numpy(), deepstack)
    mrope = prepared.mrope_rotary_cos_sin
    if not interleaved:  # Qwen2-VL's contiguous sections
        text = dataclasses.replace(ckpt.text, mrope_interleaved=False)
        mrope = mrope_cos_sin_table(prepared.position_ids, text, MAX_POSITIONS)
    request = DecodeRequest(
        input_ids=prepared.engine_input_ids, prompt_table=table, mrope_rotary_cos_sin=mrope,
        mrope_position_delta=prepared.mrope_position_delta,
        sampling=sampling or SamplingParams(max_tokens=GREEDY_TOKENS, greedy=True),
        return_context_logits=True, return_generation_logits=True)
    return Case(hf_inputs, request)


@pytest.fixture(scope="module")
def cases(preprocessor, hf_model) -> dict[str, Case]:
    return {name: make_case(preprocessor, hf_model, images) for name, images in IMAGES.items()}


@pytest.fixture(scope="module")
def hf_greedy(hf_model, cases) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per case: HF greedy tokens and HF logits over prompt + those tokens."""
    return {name: run_hf_greedy(hf_model, case.hf_inputs, GREEDY_TOKENS)
            for name, case in cases.items()}


def run_hf_greedy(model, inputs: dict, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `steps` greedy tokens, and its logits over prompt + those tokens (fp32, CPU)."""
    prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
        full = {**inputs, "input_ids": tokens}
        if "mm_token_type_ids" in inputs:
            full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                                (0, steps))
        logits = model(**full).logits[0].float().cpu()
    return tokens[0, prompt:].cpu(), logits


def assert_matches_hf(decoder: ReferenceDecoder, case: Case, expected) -> None:
    """Prompt logits, each decode step's logits and the greedy tokens equal HF's."""
    hf_tokens, hf_logits = expected
    prompt = len(case.request.input_ids)
    result = decoder.generate([case.request])[0]
    context = (result.context_logits - hf_logits[:prompt]).abs().max().item()
    assert context <= TOLERANCE, f"prompt logits differ from HF by {context:.2e}"
    steps = len(result.token_ids)
    generation = (result.generation_logits - hf_logits[prompt - 1: prompt - 1 + steps])
    assert generation.abs().max().item() <= TOLERANCE, (
        f"decode-step logits differ from HF by {generation.abs().max().item():.2e}")
    assert list(result.token_ids) == hf_tokens.tolist(), "greedy tokens differ from HF"
    assert result.finish_reason is FinishReason.LENGTH and steps == GREEDY_TOKENS


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(IMAGES))
def test_matches_hf(decoders, cases, hf_greedy, name: str, tp: int) -> None:
    assert_matches_hf(decoders[tp], cases[name], hf_greedy[name])
    result = decoders[tp].generate([cases[name].request])[0]
    assert result.visual_tokens == (len(cases[name].request.prompt_table) // 4
                                    if IMAGES[name] else 0)


@pytest.fixture(scope="module")
def swapped_mlp(converted, tmp_path_factory) -> ReferenceDecoder:
    """The TP 1 checkpoint with mlp.fc and mlp.gate exchanged (a converter bug)."""
    bad = tmp_path_factory.mktemp("swapped") / "tp1"
    shutil.copytree(converted[1], bad)
    weights = load_file(str(bad / "rank0.safetensors"))
    for i in range(4):
        fc, gate = f"transformer.layers.{i}.mlp.fc.weight", f"transformer.layers.{i}.mlp.gate.weight"
        weights[fc], weights[gate] = weights[gate], weights[fc]
    save_file(weights, str(bad / "rank0.safetensors"), {"format": "pt"})
    return ReferenceDecoder.load(bad)


@pytest.mark.parametrize("corruption", ["swap_mlp_fc_gate", "contiguous_mrope",
                                        "drop_deepstack_rows"])
@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_corrupted_layout_fails_the_check(decoders, swapped_mlp, preprocessor, hf_model,
                                          hf_greedy, name: str, corruption: str) -> None:
    """The check above is sharp: each layout mistake makes it fail."""
    decoder = swapped_mlp if corruption == "swap_mlp_fc_gate" else decoders[1]
    case = make_case(preprocessor, hf_model, IMAGES[name],
                     interleaved=corruption != "contiguous_mrope",
                     drop_deepstack=corruption == "drop_deepstack_rows")
    with pytest.raises(AssertionError, match="prompt logits differ from HF"):
        assert_matches_hf(decoder, case, hf_greedy[name])


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_decode_positions_without_the_delta_fail_the_check(decoders, cases, hf_greedy,
                                                           name: str) -> None:
    """The prompt is right but decoding at n instead of n + delta is caught."""
    request = dataclasses.replace(cases[name].request, mrope_position_delta=0)
    assert cases[name].request.mrope_position_delta < 0
    with pytest.raises(AssertionError, match="decode-step logits differ from HF"):
        assert_matches_hf(decoders[1], dataclasses.replace(cases[name], request=request),
                          hf_greedy[name])


def test_batch_equals_single_requests(decoders, cases) -> None:
    """Prompts of different lengths and lengths of output in one call: same as one by one."""
    decoder = decoders[1]
    requests = [dataclasses.replace(case.request, sampling=SamplingParams(
        max_tokens=n, greedy=True)) for case, n in zip(cases.values(), (5, 9, 3), strict=True)]
    batch = decoder.generate(requests)
    for request, result in zip(requests, batch, strict=True):
        alone = decoder.generate([request])[0]
        assert result.token_ids == alone.token_ids
        assert result.completion_tokens == request.sampling.max_tokens
        assert result.prompt_tokens == len(request.input_ids)
        assert (result.context_logits - alone.context_logits).abs().max() < 1e-5
        assert (result.generation_logits - alone.generation_logits).abs().max() < 1e-5


def test_in_flight_batch_tokens_do_not_depend_on_the_batch(decoders, cases) -> None:
    """Requests join a running batch at the next step and one is dropped mid-way: each
    request's tokens (greedy, and seeded sampling) and logits are those it makes alone, a
    joiner's first token comes at the step after add(), a dropped one makes no more."""
    decoder = decoders[1]
    text, one, two = (case.request for case in cases.values())
    sampled = dataclasses.replace(one, sampling=SamplingParams(
        max_tokens=7, temperature=1.5, top_k=500, seed=11))
    requests = [dataclasses.replace(text, sampling=SamplingParams(max_tokens=20, greedy=True)),
                sampled, dataclasses.replace(two, sampling=SamplingParams(
                    max_tokens=4, temperature=1.5, top_k=500, seed=12))]
    alone = [decoder.generate([r])[0] for r in requests]
    batch = decoder.batch()
    steps: list[list[int]] = []
    results = {}

    def step() -> None:
        events = batch.step()
        steps.append([e.request for e in events])
        for event in events:
            if event.finish_reason is not None:
                results[event.request] = batch.result(event.request)

    long = batch.add(requests[0])
    step()
    step()
    joined = batch.add(requests[1])
    step()
    late = batch.add(requests[2])
    step()
    batch.drop(long)
    assert long not in batch and len(batch) == 2
    while batch:
        step()
    assert steps[:5] == [[long], [long], [long, joined], [long, joined, late],
                         [joined, late]]
    assert len(steps) == 2 + alone[1].completion_tokens
    for key in (joined, late):
        want, got = alone[key], results[key]
        assert got.token_ids == want.token_ids and got.finish_reason is want.finish_reason
        assert (got.generation_logits - want.generation_logits).abs().max() < 1e-5
        assert (got.context_logits - want.context_logits).abs().max() < 1e-5
    assert long not in results
    assert sum(long in s for s in steps) == 4  # nothing after the drop
    with pytest.raises(KeyError, match="not in the batch"):
        batch.drop(long)


# Chunked and one-pass prefill differ only in the order attention sums its terms (fp32).
CHUNK_TOLERANCE = 1e-5


def run_batch(decoder: ReferenceDecoder, requests: list[DecodeRequest],
              **options) -> list[DecodeResult]:
    """`requests` to completion in one batch made with decoder.batch(**options)."""
    batch = decoder.batch(**options)
    keys = [batch.add(request) for request in requests]
    results = {}
    while batch:
        for event in batch.step():
            if event.finish_reason is not None:
                results[event.request] = batch.result(event.request)
    return [results[key] for key in keys]


@pytest.mark.parametrize("where", ["inside_the_image", "every_position"])
def test_chunked_prefill_equals_one_pass(decoders, cases, where: str) -> None:
    """Chunked context: prompts prefilled in chunks (each chunk's K/V written at its offset,
    attending to every earlier position, its own MRoPE and DeepStack rows) give the logits
    and tokens of one pass, with a chunk boundary inside the image's tokens, and beside a
    shorter prompt that is padding in the later chunks."""
    decoder = decoders[1]
    image, text = cases["one_image"].request, cases["text"].request
    visual = np.flatnonzero(np.asarray(image.input_ids) >= decoder.config.vocab_size)
    chunk = int(visual[0]) + 2 if where == "inside_the_image" else 1
    assert any(visual[0] < boundary <= visual[-1]
               for boundary in range(chunk, len(image.input_ids), chunk))
    requests = [dataclasses.replace(r, sampling=SamplingParams(max_tokens=4, greedy=True))
                for r in (image, text)]
    assert len(text.input_ids) < len(image.input_ids)
    for want, got in zip(run_batch(decoder, requests),
                         run_batch(decoder, requests, context_chunk=chunk), strict=True):
        assert got.token_ids == want.token_ids
        for logits in ("context_logits", "generation_logits"):
            difference = (getattr(got, logits) - getattr(want, logits)).abs().max().item()
            assert difference <= CHUNK_TOLERANCE, f"{logits} differ by {difference:.2e}"


def test_unreferenced_prompt_table_rows_do_not_leak(decoders, cases) -> None:
    """The engine's prompt-table buffer is never zeroed: a text-only request's table (the
    row its text tokens read) and rows no fake id references may hold NaN/Inf. They must not
    change a single logit; poisoning a row a visual token does read shows the check bites."""
    decoder = decoders[1]
    text, image = cases["text"].request, cases["one_image"].request
    per_token = decoder.config.rows_per_visual_token
    poison = np.full((per_token, decoder.config.hidden_size), np.nan, np.float32)
    poison[1::2] = np.inf
    clean = [dataclasses.replace(text, prompt_table=np.zeros_like(poison)), image]
    poisoned = [dataclasses.replace(text, prompt_table=poison),
                dataclasses.replace(image, prompt_table=np.concatenate(
                    [image.prompt_table, poison]))]
    for want, got in zip(decoder.generate(clean), decoder.generate(poisoned), strict=True):
        assert got.token_ids == want.token_ids
        assert torch.equal(got.context_logits, want.context_logits)
        assert torch.equal(got.generation_logits, want.generation_logits)

    read = image.prompt_table.copy()
    read[1] = np.nan  # DeepStack feature 0 of visual token 0
    broken = decoder.generate([dataclasses.replace(image, prompt_table=read)])[0]
    assert not torch.isfinite(broken.context_logits).all()


def test_stream_and_callback(decoders, cases) -> None:
    decoder = decoders[2]
    requests = [dataclasses.replace(cases["text"].request, sampling=SamplingParams(
        max_tokens=n, greedy=True)) for n in (4, 2)]
    events = list(decoder.stream(requests))
    seen: list[TokenEvent] = []
    results = decoder.generate(requests, on_token=seen.append)
    assert events == seen
    assert [e.request for e in events] == [0, 1, 0, 1, 0, 0]  # one token per request per step
    for b, result in enumerate(results):
        mine = [e for e in events if e.request == b]
        assert tuple(e.token_id for e in mine) == result.token_ids
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + [
            FinishReason.LENGTH]


def test_sampling(decoders, cases) -> None:
    decoder = decoders[1]
    base = cases["one_image"].request

    def run(**params):
        request = dataclasses.replace(base, sampling=SamplingParams(**params))
        return decoder.generate([request])[0]

    greedy = run(max_tokens=6, greedy=True)
    assert run(max_tokens=6, top_k=1, seed=5).token_ids == greedy.token_ids
    assert run(max_tokens=6, temperature=0).token_ids == greedy.token_ids
    sampled = run(max_tokens=12, temperature=1.5, top_p=0.95, top_k=500, seed=7)
    assert sampled.token_ids == run(max_tokens=12, temperature=1.5, top_p=0.95, top_k=500,
                                    seed=7).token_ids
    assert sampled.token_ids != run(max_tokens=12, temperature=1.5, top_p=0.95, top_k=500,
                                    seed=8).token_ids
    stop = greedy.token_ids[2]
    stopped = run(max_tokens=6, greedy=True, stop_token_ids=(stop, 999))
    first = greedy.token_ids.index(stop)
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason is FinishReason.STOP


def test_choose_token_filters() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)

    def draws(**params) -> set[int]:
        params = SamplingParams(**params)
        return {choose_token(logits, params, generator) for _ in range(300)}

    assert draws(greedy=True) == {0}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.6) == {0, 1}  # 0.5 < 0.6, 0.5 + 0.3 reaches it
    assert draws(top_p=0.5) == {0}
    assert draws(top_p=1.0) == {0, 1, 2, 3}
    assert draws(temperature=0.05) == {0}


def test_a_temperature_below_float32s_normal_range_scales_as_tensorrt_llm_scales() -> None:
    """TensorRT-LLM multiplies the logits by 1 / (temperature + 1e-6) in float32 (not at all at
    1): 1e-40 and 1e-45 scale as 0 does, so they are greedy; a temperature beyond float32
    scales by 0 (uniform). Dividing by them made inf and NaN for torch.multinomial."""
    from qvl_trt.llm.sampling import inverse_temperature, scales_as_greedy

    logits = torch.tensor([3.0, 2.9999, -1.0, 0.5])
    generator = torch.Generator().manual_seed(0)
    assert inverse_temperature(1.0) == 1 and inverse_temperature(0.0) == np.float32(1 / 1e-6)
    assert inverse_temperature(0.5) == np.float32(1) / np.float32(0.500001)
    for tiny in (1e-40, 1e-45, 0.0):
        assert scales_as_greedy(tiny) and SamplingParams(temperature=tiny).is_greedy
        assert {choose_token(logits, SamplingParams(temperature=tiny), generator)
                for _ in range(20)} == {0}
    assert not scales_as_greedy(1e-3) and inverse_temperature(1e39) == 0
    uniform = SamplingParams(temperature=3.0e38)  # the largest float32 scales by ~0
    assert {choose_token(logits, uniform, generator) for _ in range(200)} == {0, 1, 2, 3}


def test_min_tokens_holds_back_the_end_id_only() -> None:
    """TensorRT-LLM masks the end id's logit until min_tokens tokens (penaltyKernels.cu);
    another id, like a stop word, is not held back."""
    logits = torch.tensor([5.0, 1.0, 4.0, 0.0])  # 0: the end id, the likeliest
    generator = torch.Generator().manual_seed(0)
    held = SamplingParams(greedy=True, min_tokens=2, end_id=0)
    assert [choose_token(logits, held, generator, n) for n in range(4)] == [2, 2, 0, 0]
    sampled = SamplingParams(temperature=0.5, min_tokens=3, end_id=0)
    assert 0 not in {choose_token(logits, sampled, generator, 2) for _ in range(100)}
    assert choose_token(logits, SamplingParams(greedy=True, min_tokens=2, end_id=2),
                        generator, 0) == 0
    with pytest.raises(InputError, match="min_tokens = -1 must be an integer >= 0"):
        SamplingParams(min_tokens=-1)


def test_top_k_above_tensorrt_llms_limit_is_clipped(caplog) -> None:
    """top_k 5000 over 2000 tokens would keep them all; TensorRT-LLM clips it to TOP_K_MAX
    (1024) with a warning, and so do the sampling parameters: only the 1024 likeliest are
    drawn from nearly uniform logits."""
    logits = -torch.arange(2000, dtype=torch.float32) * 1e-6
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING"):
        params = SamplingParams(top_k=5000)
    assert params.top_k == TOP_K_MAX == 1024
    assert "top_k 5000 is larger than the 1024 TensorRT-LLM samples from" in caplog.text
    drawn = {choose_token(logits, params, generator) for _ in range(300)}
    assert max(drawn) < TOP_K_MAX and len(drawn) > 100


# ---- bad input -------------------------------------------------------------------------------


def _bad(case: Case, **changes) -> DecodeRequest:
    return dataclasses.replace(case.request, **changes)


@pytest.mark.parametrize("change, message", [
    (lambda c, cfg: _bad(c, input_ids=()), "input_ids is empty"),
    (lambda c, cfg: _bad(c, prompt_table=c.request.prompt_table[:, :10]),
     r"prompt_table has shape \[\d+, 10\]; expected \[\(1\+K\) \* visual tokens, 64\]"),
    (lambda c, cfg: _bad(c, prompt_table=c.request.prompt_table[:-1]), "prompt_table has shape"),
    (lambda c, cfg: _bad(c, prompt_table=None), "nor a fake id indexing the 0-row prompt table"),
    (lambda c, cfg: _bad(c, input_ids=c.request.input_ids + (cfg.vocab_size + 10**6,)),
     r"token id 1151936 is neither a vocabulary id \(< 151936\)"),
    (lambda c, cfg: _bad(c, input_ids=c.request.input_ids + (cfg.vocab_size + 1,)),
     r"not vocab_size \+ 4 \* i"),
    (lambda c, cfg: _bad(c, mrope_rotary_cos_sin=c.request.mrope_rotary_cos_sin[:100]),
     "mrope_rotary_cos_sin has 100 values; expected max_position_embeddings x rotary_dim"),
    (lambda c, cfg: _bad(c, sampling=SamplingParams(max_tokens=MAX_POSITIONS)),
     "exceed max_position_embeddings 1024"),
])
def test_bad_requests(decoders, cases, change, message) -> None:
    decoder = decoders[1]
    with pytest.raises(InputError, match=message):
        decoder.generate([cases["text"].request, change(cases["one_image"], decoder.config)])


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 0}, "max_tokens = 0 must be an integer >= 1"),
    ({"temperature": -1.0}, "temperature = -1.0 must be a number >= 0"),
    ({"top_p": 0.0}, r"top_p = 0.0 must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k = -2 must be an integer >= 0"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_sampling_params(params, message) -> None:
    with pytest.raises(InputError, match=message):
        SamplingParams(**params)


def test_numpy_scalars_become_python_numbers() -> None:
    """Triton hands numpy scalars over."""
    params = SamplingParams(max_tokens=np.int32(4), temperature=np.float32(0.5),
                            top_k=np.int64(3), seed=np.uint64(7), stop_token_ids=(np.int32(5),))
    assert (params.max_tokens, params.top_k, params.seed, params.stop_token_ids) == (4, 3, 7, (5,))
    assert type(params.temperature) is float and type(params.max_tokens) is int
    request = DecodeRequest(np.array([1, 2], np.int32), np.zeros(4), np.int64(-3))
    assert request.input_ids == (1, 2) and type(request.mrope_position_delta) is int


def test_bad_checkpoint_folder(converted, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="config.json is missing"):
        ReferenceDecoder.load(tmp_path)
    broken = tmp_path / "tp2"
    shutil.copytree(converted[2], broken)
    (broken / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors is missing: config.json "
                       "declares TP size 2"):
        ReferenceDecoder.load(broken)


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: run scripts/verify_gpu.sh on a GPU "
                           "machine")
@pytest.mark.parametrize("dtype, tolerance", [("float32", TOLERANCE), ("float16", 2e-2)])
def test_cuda_matches_hf_on_cuda(tiny_ckpt, preprocessor, tmp_path, dtype: str,
                                 tolerance: float) -> None:
    """The decoder on CUDA (fp32, and fp16 as the engine runs) against HF on CUDA; the
    prompt table comes from HF's tower on CUDA in the same precision."""
    import transformers

    path = convert_checkpoint(tiny_ckpt, tmp_path / dtype, max_seq_len=MAX_POSITIONS,
                              dtype=dtype).out
    decoder = ReferenceDecoder.load(path, device="cuda")
    hf_cuda = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        str(tiny_ckpt), dtype=getattr(torch, dtype)).eval().cuda()
    steps = 8
    for images in IMAGES.values():
        case = make_case(preprocessor, hf_cuda, images,
                         sampling=SamplingParams(max_tokens=steps, greedy=True))
        inputs = {k: v.cuda() for k, v in case.hf_inputs.items()}
        prompt = inputs["input_ids"].shape[1]
        tokens, expected = run_hf_greedy(hf_cuda, inputs, steps)
        result = decoder.generate([case.request])[0]
        context = (result.context_logits.cpu() - expected[:prompt]).abs().max().item()
        assert context <= tolerance, f"{dtype} prompt logits differ by {context:.2e}"
        generation = (result.generation_logits - expected[prompt - 1: prompt - 1 + steps])
        assert generation.abs().max().item() <= tolerance
        if dtype == "float32":
            assert list(result.token_ids) == tokens.tolist()
