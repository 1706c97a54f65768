"""The request entry point: prompt ids as HF's processor builds them, the profile's limits,
the DeepStack prompt-table layout, and `qvl-trt preprocess` end to end (without torch)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_harness import run_cli
from PIL import Image

from qvl_trt.chat_messages import user_message
from qvl_trt.errors import InputError
from qvl_trt.mm.prompt_table import (
    assemble_prompt_table,
    fake_token_ids,
    prompt_table_extra_ids,
    split_prompt_table,
    visual_token_positions,
)
from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
from qvl_trt.profiles import load_profile

TENSOR_NAMES = {
    "input_ids", "engine_input_ids", "position_ids", "mrope_position_deltas",
    "mrope_rotary_cos_sin", "prompt_table_extra_ids", "prompt_vocab_size", "pixel_values",
    "image_grid_thw", "image_hashes", "pos_interp_indices", "pos_interp_weights",
    "rope_position_ids",
}


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def limits() -> RequestLimits:
    return RequestLimits.from_profile(load_profile("4090"))


@pytest.fixture(scope="module")
def pre(tiny_ckpt, limits) -> RequestPreprocessor:
    return RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)


def test_prompt_ids_equal_hf_processor_expansion(pre, tiny_ckpt):
    """HF's Qwen3VLProcessor repeats each <|image_pad|> in the text, then tokenises."""
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare 1234 apples, naïve café, 你好:"},
            {"type": "image"}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": "data:..."}}]},
        {"role": "assistant", "content": "Which one?"},
        {"role": "user", "content": "Both."},
    ]
    request = pre.prepare(messages=messages, images=[_png(200, 120, 1), _png(64, 300, 2)])
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == request.text
    for count in request.image_token_counts:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * count, 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    assert request.input_ids.tolist() == hf_tokenizer(text)["input_ids"]
    assert request.input_ids.dtype == np.int32


def test_request_tensors_fit_together(pre, tiny_ckpt):
    from qvl_trt.checkpoint import open_checkpoint

    ckpt = open_checkpoint(tiny_ckpt)
    images = [_png(300, 200, 3), _png(120, 90, 4)]
    request = pre.prepare(messages=user_message("What is shown?", 2), images=images)
    tensors = request.tensors()
    assert set(tensors) == TENSOR_NAMES
    seq, patches = request.num_tokens, tensors["pixel_values"].shape[0]
    grids = tensors["image_grid_thw"]
    assert patches == int(grids.prod(axis=1).sum()) == tensors["pos_interp_indices"].shape[0]
    assert tensors["position_ids"].shape == (3, seq)
    assert tensors["mrope_rotary_cos_sin"].shape == (16384 * ckpt.text.head_dim,)  # max_seq_len
    visual = request.input_ids == ckpt.token_ids.image
    assert int(visual.sum()) == patches // 4 == sum(request.image_token_counts)
    assert tensors["prompt_vocab_size"][0] == (1 + ckpt.vision.deepstack_count) * patches // 4
    assert np.array_equal(tensors["engine_input_ids"][~visual], request.input_ids[~visual])
    assert np.all(tensors["engine_input_ids"][visual] >= ckpt.text.vocab_size)
    hashes = tensors["image_hashes"]
    assert hashes[0] != hashes[1]
    extra = tensors["prompt_table_extra_ids"]
    assert set(extra[visual].tolist()) == set(hashes.tolist()) and not extra[~visual].any()
    again = pre.prepare(messages=user_message("What is shown?", 2), images=images)
    assert np.array_equal(again.tensors()["image_hashes"], hashes)
    # 8-bit pixels, each image a view of the request's one buffer (nothing concatenated).
    assert tensors["pixel_values"].dtype == np.uint8
    first = request.images[0].num_patches
    assert np.shares_memory(request.images[0].pixel_values, request.pixel_values[:first])
    assert np.shares_memory(request.images[1].pixel_values, request.pixel_values[first:])


def test_prompt_table_round_trip():
    rng = np.random.default_rng(0)
    vocab, image_id, k, hidden = 1000, 7, 3, 16
    ids = np.array([1, 2, image_id, image_id, image_id, 3, image_id, image_id, 4], np.int32)
    fake = fake_token_ids(ids, image_token_id=image_id, vocab_size=vocab, deepstack_count=k)
    assert fake[ids != image_id].tolist() == ids[ids != image_id].tolist()
    assert fake[ids == image_id].tolist() == [vocab + 4 * i for i in range(5)]
    positions, visual_index = visual_token_positions(fake, vocab_size=vocab, deepstack_count=k)
    assert positions.tolist() == np.flatnonzero(ids == image_id).tolist()
    assert visual_index.tolist() == list(range(5))

    main = rng.normal(size=(5, hidden)).astype(np.float16)
    deepstack = [rng.normal(size=(5, hidden)).astype(np.float16) for _ in range(k)]
    table = assemble_prompt_table(main, deepstack)
    assert table.shape == (5 * (1 + k), hidden)
    rows = fake[positions] - vocab  # what the engine's prompt-tuning lookup reads
    assert np.array_equal(table[rows], main)
    for j in range(k):
        assert np.array_equal(table[rows + 1 + j], deepstack[j])
    back_main, back_deepstack = split_prompt_table(table, k)
    assert np.array_equal(back_main, main)
    assert all(np.array_equal(a, b) for a, b in zip(back_deepstack, deepstack, strict=True))


def test_prompt_table_errors():
    with pytest.raises(InputError, match="not 4 rows per visual token"):
        split_prompt_table(np.zeros((6, 8)), 3)
    with pytest.raises(InputError, match="deepstack feature 1 has shape"):
        assemble_prompt_table(np.zeros((2, 8)), [np.zeros((2, 8)), np.zeros((3, 8))])
    with pytest.raises(InputError, match="not vocab_size \\+ 4 \\* i"):
        visual_token_positions(np.array([1, 1001]), vocab_size=1000, deepstack_count=3)
    with pytest.raises(InputError, match="holds 2 image tokens, the images 3"):
        prompt_table_extra_ids(np.array([5, 5]), image_token_id=5, image_hashes=[9],
                               image_token_counts=[3])


@pytest.mark.parametrize("messages, images, message", [
    (user_message("hi", 3), [b"x", b"y", b"z"], "request has 3 images, the engine allows 2"),
    (user_message("hi", 1), [], "messages hold 1 image parts but 0 images were sent"),
    (user_message("hi <|image_pad|>", 0), [], "holds 1 image placeholders for 0 images"),
    (user_message("hi", 1), [b""], "image 1: image is empty"),
    (user_message("hi", 1), [_png(64, 64, 0)[:300]], "image 1: PNG image could not be decoded"),
    # images decode side by side: the refusal still names the bad one
    (user_message("hi", 2), [_png(64, 64, 0), _png(64, 64, 1)[:300]],
     "image 2: PNG image could not be decoded"),
    ([{"role": "user", "content": [{"type": "audio"}]}], [], "neither {type: text"),
    ([{"role": "robot", "content": "hi"}], [], "has role 'robot'"),
    ("hello", [], "messages must be a non-empty list"),
    ([{"role": "assistant", "content": [{"type": "image"}]}], [b"x"],
     "images go in user messages"),
], ids=["too-many-images", "missing-image", "pad-in-text", "empty-image", "truncated-image",
        "second-image-truncated", "audio", "bad-role", "not-a-list", "image-in-assistant"])
def test_bad_requests_are_refused(pre, messages, images, message):
    with pytest.raises(InputError, match=message.replace("+", r"\+").replace("{", r"\{")):
        pre.prepare(messages=messages, images=images)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two pixel pool threads")
def test_a_refused_request_leaves_no_decode_running(pre, monkeypatch):
    """A request's images decode side by side; one refused (image 1 is corrupt) cancels the
    decodes not started and waits for the others (image 2 here), so none runs on behind the
    error."""
    import threading

    from qvl_trt.mm import request

    started, decoded = threading.Event(), []
    load_rgb, good, corrupt = request.load_rgb, _png(64, 64, 0), _png(64, 64, 1)[:300]

    def observed_load_rgb(image, **kwargs):
        if image is corrupt:  # fails once image 2 is decoding
            assert started.wait(10)
            return load_rgb(image, **kwargs)
        started.set()
        time.sleep(0.3)
        decoded.append(load_rgb(image, **kwargs))
        return decoded[-1]

    monkeypatch.setattr(request, "load_rgb", observed_load_rgb)
    with pytest.raises(InputError, match="image 1: PNG image could not be decoded"):
        pre.prepare(messages=user_message("hi", 2), images=[corrupt, good])
    assert len(decoded) == 1


def test_prompt_longer_than_the_engine_allows(tiny_ckpt, limits):
    from dataclasses import replace

    short = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(limits, max_input_len=64))
    with pytest.raises(InputError, match=r"prompt has \d+ tokens \(\d+ of them for 1 images\), "
                                         "the engine allows 64"):
        short.prepare(messages=user_message("Describe.", 1), images=[_png(256, 256, 5)])


def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized(tiny_ckpt, limits):
    from dataclasses import replace

    short = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(limits, max_input_len=64))
    prompts = short.prompts
    assert prompts.max_token_bytes == 128  # Qwen's longest token: 128 spaces
    bound = 64 * prompts.max_token_bytes
    # The bound is tight: that many bytes of spaces are 64 tokens, one byte more is 65.
    assert len(prompts.tokenizer(" " * bound)["input_ids"]) == 64
    assert len(prompts.tokenizer(" " * (bound + 1))["input_ids"]) == 65
    prompts.check_fits(" " * bound, 64)
    # Break it: one byte more; a request above it is refused by its size, not its tokens.
    with pytest.raises(InputError, match=rf"^prompt of {bound + 1} bytes cannot fit in the "
                                         r"engine's 64 tokens \(a token covers at most 128 "
                                         rf"bytes, so {bound} bytes at most\); shorten the text$"):
        prompts.check_fits(" " * (bound + 1), 64)
    with pytest.raises(InputError, match=r"^prompt of \d+ bytes cannot fit in the engine's 64"):
        short.prepare(messages=user_message("word " * 2000, 0))


def test_visual_tokens_are_counted_from_the_headers_before_decoding(tiny_ckpt, limits):
    """Two 256x256 PNGs whose pixel data is cut off: their headers alone make 128 visual
    tokens, above a cap of 127, so the request is refused before either decodes (decoding
    would fail with "could not be decoded")."""
    from dataclasses import replace

    capped = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(limits, max_visual_tokens=127))
    cut = [_png(256, 256, 8)[:400], _png(256, 256, 9)[:400]]
    with pytest.raises(InputError, match=r"^request has 128 visual tokens in 2 images, the "
                                         r"engine's prompt table holds 127 per request"):
        capped.prepare(messages=user_message("Compare.", 2), images=cut)


def test_visual_tokens_above_the_prompt_table_cap_are_refused(tiny_ckpt, limits):
    from dataclasses import replace

    assert limits.max_visual_tokens == load_profile("4090").limits.max_visual_tokens_per_request
    images = [_png(256, 256, 6), _png(256, 256, 7)]  # 64 visual tokens each
    at_cap = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(limits, max_visual_tokens=128))
    assert sum(at_cap.prepare(messages=user_message("Compare.", 2), images=images)
               .image_token_counts) == 128
    # Break it: one token less than the two images make.
    capped = RequestPreprocessor.from_checkpoint(tiny_ckpt, replace(limits, max_visual_tokens=127))
    with pytest.raises(InputError, match=r"request has 128 visual tokens in 2 images, the "
                                         r"engine's prompt table holds 127 per request: send "
                                         r"fewer or smaller images, or rebuild with a larger "
                                         r"limits\.max_visual_tokens_per_request$"):
        capped.prepare(messages=user_message("Compare.", 2), images=images)


def test_preprocess_cli_round_trip(tiny_ckpt, pre, tmp_path):
    """The CLI's .npz equals prepare() called directly."""
    paths = []
    for n, (w, h) in enumerate([(300, 200), (96, 500)]):
        paths.append(tmp_path / f"image{n}.png")
        paths[-1].write_bytes(_png(w, h, 10 + n))
    out = tmp_path / "out" / "tensors.npz"
    result = run_cli("preprocess", "--model", str(tiny_ckpt), "--image", str(paths[0]),
                     "--image", str(paths[1]), "--prompt", "Which is larger?", "--gpu", "4090",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "prompt tokens" in result.stdout and str(out) in result.stdout.replace("\n", "")
    assert sorted(p.name for p in out.parent.iterdir()) == ["tensors.npz"]  # no temp file left
    saved = np.load(out)
    direct = pre.prepare(messages=user_message("Which is larger?", 2),
                         images=[p.read_bytes() for p in paths]).tensors()
    assert set(saved.files) == TENSOR_NAMES
    for name in TENSOR_NAMES:
        assert saved[name].dtype == direct[name].dtype, name
        assert np.array_equal(saved[name], direct[name]), name


def test_preprocess_cli_bad_image_is_one_line(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)
    result = run_cli("preprocess", "--model", str(tiny_ckpt), "--image", str(bad), "--prompt",
                     "x", "--out", str(tmp_path / "t.npz"))
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: image 1:")
    assert "Traceback" not in result.stderr and not (tmp_path / "t.npz").exists()


def test_preprocessing_never_imports_torch(tiny_ckpt):
    """The Triton preprocessing model stays light: numpy, PIL and the tokenizer only."""
    script = (
        "import sys\n"
        "from qvl_trt.chat_messages import user_message\n"
        "from qvl_trt.mm.request import RequestLimits, RequestPreprocessor\n"
        "from qvl_trt.profiles import load_profile\n"
        f"pre = RequestPreprocessor.from_checkpoint({str(tiny_ckpt)!r}, "
        "RequestLimits.from_profile(load_profile('4090')))\n"
        f"pre.prepare(messages=user_message('hi', 1), images=[{_png(64, 64, 1)!r}])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_triton_preprocessing_step_enforces_the_profile_cap(tmp_path, tiny_build, tiny_ckpt,
                                                                  triton_profile):
    """repository.py writes the cap into the preprocessing model's parameters and
    PreprocessingParameters reads it back: a request over it is refused there."""
    from qvl_trt.triton.contract import PreprocessingParameters
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.pbconfig import read_config
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path
    params = {k: v.string_value for k, v in read_config(repo / "preprocessing").parameters.items()}
    cap = load_profile(str(triton_profile)).limits.max_visual_tokens_per_request
    assert int(params["max_visual_tokens"]) == cap == 128
    params["max_visual_tokens"] = "127"
    step = Preprocessor(tiny_ckpt, PreprocessingParameters.from_parameters(params))
    with pytest.raises(InputError, match="holds 127 per request"):
        step.requests.prepare(messages=user_message("Compare.", 2),
                              images=[_png(256, 256, 6), _png(256, 256, 7)])


def test_the_stop_token_bound_is_written_into_the_repository_and_enforced(tmp_path, tiny_build,
                                                                          tiny_ckpt):
    """repository.py writes RequestBounds' defaults into the preprocessing model's parameters;
    a lowered max_stop_tokens there refuses stop strings that tokenize to more, and accepts
    them at the limit."""
    from qvl_trt.mm.request import RequestBounds
    from qvl_trt.triton.contract import PreprocessingParameters
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.pbconfig import read_config
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path
    params = {k: v.string_value for k, v in read_config(repo / "preprocessing").parameters.items()}
    assert params["max_stop_tokens"] == str(RequestBounds().max_stop_tokens)
    step = Preprocessor(tiny_ckpt, PreprocessingParameters.from_parameters(params))
    stop = np.array([b"a cat", b"on the mat"], object)
    tokens = sum(len(step.requests.prompts.tokenizer.encode(s.decode(), add_special_tokens=False))
                 for s in stop)
    request = {"text_input": b"Hi", "max_tokens": np.int32(2), "stop": stop}
    step(request)
    step = Preprocessor(tiny_ckpt, PreprocessingParameters.from_parameters(
        {**params, "max_stop_tokens": str(tokens)}))
    step(request)
    step = Preprocessor(tiny_ckpt, PreprocessingParameters.from_parameters(
        {**params, "max_stop_tokens": str(tokens - 1)}))
    with pytest.raises(InputError, match=f"tokens of all stop strings is {tokens}, above the "
                       f"limit of {tokens - 1}"):
        step(request)


def test_the_preprocessing_step_gives_back_what_a_large_image_freed(tiny_ckpt):
    """An RGBA PNG of 4000x4000 (a few hundred MB decoded and converted, in the pixel pool's
    threads too): after its request the step's RSS is back within the trim threshold of
    where it was (glibc alone keeps most of it)."""
    from qvl_trt.triton.repository import RepoOptions, preprocessing_parameters
    from qvl_trt.triton.runtime import preprocessing

    step = preprocessing.Preprocessor(
        tiny_ckpt, preprocessing_parameters(load_profile("4090"), RepoOptions()))
    pixels = np.full((4000, 4000, 4), 255, np.uint8)
    pixels[500:3500, 500:3500] = (200, 40, 40, 128)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buffer, format="PNG", compress_level=1)
    row = {"text_input": b"Describe.", "max_tokens": np.int32(2),
           "image_bytes": np.array([buffer.getvalue()], object)}
    before = preprocessing._rss_bytes()
    for _ in range(2):
        step(row)
        assert preprocessing._rss_bytes() - before < preprocessing._TRIM_ABOVE_IDLE_BYTES


# ---- per-request visual budgets ---------------------------------------------------------

def _image_part(**fields) -> dict:
    """An image_url part: `detail` goes into image_url (OpenAI's), the rest on the part."""
    detail = fields.pop("detail", None)
    url = {"url": "data:,"} | ({} if detail is None else {"detail": detail})
    return {"type": "image_url", "image_url": url, **fields}


def _one_image(part: dict, **body) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}]


@pytest.fixture(scope="module")
def photo() -> bytes:
    return _png(1920, 1080, 40)


@pytest.fixture(scope="module")
def hf_image_processor(tiny_ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoImageProcessor.from_pretrained(str(tiny_ckpt), backend="pil")


@pytest.mark.parametrize("part, kwargs, bounds", [
    (_image_part(detail="low"), None, (65536, 262144)),
    (_image_part(detail="high"), None, (65536, 2097152)),
    (_image_part(), None, (65536, 2097152)),
    (_image_part(min_pixels=100000, max_pixels=400000), None, (100000, 400000)),
    (_image_part(max_pixels=123456), None, (65536, 123456)),
    # request-wide (vLLM's mm_processor_kwargs); the part's own field wins over it
    (_image_part(), {"max_pixels": 300000}, (65536, 300000)),
    (_image_part(max_pixels=200000), {"min_pixels": 150000, "max_pixels": 300000},
     (150000, 200000)),
    (_image_part(detail="low"), {"max_pixels": 300000}, (65536, 262144)),
], ids=["low", "high", "auto", "min-and-max", "max", "request-wide", "part-over-request",
        "detail-over-request"])
def test_a_budget_resizes_as_hf_told_the_same_bounds(pre, photo, hf_image_processor, part,
                                                    kwargs, bounds):
    """The image's pixels at a budget equal HF's processor called with that budget's
    min_pixels/max_pixels (the 4090 profile: 65536 to 2097152 pixels per image)."""
    checked = pre.limits.checked_messages(_one_image(part), kwargs)
    request = pre.prepare(messages=checked, images=[photo])
    hf = hf_image_processor(Image.open(io.BytesIO(photo)), return_tensors="np",
                            size={"shortest_edge": bounds[0], "longest_edge": bounds[1]})
    assert request.image_grid_thw.tolist() == hf["image_grid_thw"].tolist()
    assert np.array_equal(pre.pixels.normalise(request.pixel_values), hf["pixel_values"])
    merge = pre.checkpoint.vision.spatial_merge_size ** 2
    assert request.media_tokens == (int(hf["image_grid_thw"][0].prod()) // merge, 0)


def test_low_and_high_detail_token_counts_of_a_1080p_image(tiny_ckpt, limits, photo,
                                                           triton_profile):
    """The counts docs/openai.md states: the checkpoint's own bounds (the 2B's) and a shipped
    profile give 252 tokens at low, 2040 at high; the test profile (65536 pixels at most)
    gives 60 at both."""
    def tokens(preprocessor, detail):
        return preprocessor.prepare(messages=_one_image(_image_part(detail=detail)),
                                    images=[photo]).media_tokens[0]

    for preprocessor in (RequestPreprocessor.from_checkpoint(tiny_ckpt),
                         RequestPreprocessor.from_checkpoint(tiny_ckpt, limits)):
        assert [tokens(preprocessor, d) for d in ("low", "high", "auto")] == [252, 2040, 2040]
    small = RequestPreprocessor.from_checkpoint(
        tiny_ckpt, RequestLimits.from_profile(load_profile(str(triton_profile))))
    assert [tokens(small, d) for d in ("low", "high")] == [60, 60]


def test_the_same_image_at_two_budgets_shares_no_cache_key(pre, photo):
    """The vision cache's key (image hash and grid) and the KV-reuse ids of the image's
    tokens differ by budget; at one budget they are the same (a follow-up reuses them).
    Break it (hash the image's file instead of its rows at the budget): the keys of the two
    budgets are equal and this fails."""
    from qvl_trt.vision.cache import RowCache

    def keys(part):
        request = pre.prepare(messages=_one_image(part), images=[photo])
        visual = request.prompt_table_extra_ids[request.input_ids == 151655]
        cache = {(int(h), *map(int, g)) for h, g in zip(request.image_hashes,
                                                        request.image_grid_thw, strict=True)}
        return cache, set(visual.tolist())

    low, high = keys(_image_part(detail="low")), keys(_image_part(detail="high"))
    assert low[0].isdisjoint(high[0]) and low[1].isdisjoint(high[1])
    assert keys(_image_part(detail="low")) == low
    assert keys(_image_part(max_pixels=262144)) == low  # the same rows: rightly shared
    rows = RowCache(2**20)
    rows.put(next(iter(low[0])), np.zeros((1, 1)))
    assert rows.get(next(iter(high[0]))) is None


@pytest.mark.parametrize("part, kwargs, error, field, words", [
    (_image_part(max_pixels=2097153), None, "EngineLimitError", None,
     r"max_pixels = 2097153 is above the deployment's maximum of 2097152 pixels per image "
     r"\(limits\.vision_max_pixels\)"),
    (_image_part(min_pixels=3000000), None, "EngineLimitError", None,
     "min_pixels = 3000000 is above the deployment's maximum"),
    (_image_part(), {"max_pixels": 4000000}, "EngineLimitError", None,
     r"messages\[0\]\.content\[0\]\.max_pixels = 4000000 is above"),
    (_image_part(max_pixels=1000), None, "FieldError", "messages[0].content[0].max_pixels",
     "below the deployment's minimum of 65536"),
    (_image_part(min_pixels=300000, max_pixels=200000), None, "FieldError",
     "messages[0].content[0].min_pixels", "min_pixels 300000 is above max_pixels 200000"),
    (_image_part(min_pixels=300000), {"max_pixels": 200000}, "FieldError",
     "messages[0].content[0].min_pixels", "min_pixels 300000 is above max_pixels 200000"),
    (_image_part(detail="ultra"), None, "FieldError", "messages[0].content[0].image_url.detail",
     "detail = \"ultra\" is not one of low, high, auto"),
    (_image_part(detail="low", max_pixels=100000), None, "FieldError",
     "messages[0].content[0].max_pixels", "gives both image_url.detail 'low' and max_pixels"),
    (_image_part(max_pixels="many"), None, "FieldError", "messages[0].content[0].max_pixels",
     "must be a positive integer"),
    (_image_part(), {"do_resize": False}, "FieldError", "mm_processor_kwargs.do_resize",
     "is not supported"),
    (_image_part(), {"fps": 0}, "FieldError", "mm_processor_kwargs.fps", "above 0"),
], ids=["above-max", "min-above-max", "request-wide-above", "below-min", "min-over-max",
        "min-over-request-max", "unknown-detail", "detail-and-pixels", "not-a-number",
        "unknown-kwarg", "zero-fps"])
def test_a_budget_outside_the_deployments_limits_is_refused_not_clamped(pre, photo, part,
                                                                       kwargs, error, field,
                                                                       words):
    from qvl_trt import errors

    with pytest.raises(getattr(errors, error), match=words) as caught:
        pre.prepare(messages=pre.limits.checked_messages(_one_image(part), kwargs),
                    images=[photo])
    assert getattr(caught.value, "field", None) == field


def test_a_videos_budget_sets_its_frames_and_frame_size(pre):
    """max_frames samples a file down (and refuses a frame list above it), max_pixels caps
    each frame, fps sets the sampling rate; request-wide through mm_processor_kwargs; above
    the deployment's limits refused."""
    from video_clips import video_file

    from qvl_trt.chat_messages import VideoFile
    from qvl_trt.errors import EngineLimitError

    clip = video_file(20, 320, 240, rate=10)  # 2 s

    def grid(part=None, kwargs=None):
        messages = [{"role": "user", "content": [{"type": "video", **(part or {})},
                                                 {"type": "text", "text": "What happens?"}]}]
        checked = pre.limits.checked_messages(messages, kwargs)
        fps = checked.video_budgets[0].fps
        request = pre.prepare(messages=checked, images=[], videos=[VideoFile(clip, fps)])
        return request.videos[0].grid_thw, request.media_tokens

    (t, h, w), tokens = grid()
    assert t == 2 and tokens == (0, t * h * w // 4)  # 2 fps: 4 frames, two groups
    assert grid({"fps": 4})[0][0] == 4
    assert grid(None, {"fps": 4})[0][0] == 4
    assert grid({"fps": 4, "max_frames": 4})[0][0] == 2
    assert grid(None, {"fps": 4, "max_frames": 4})[0][0] == 2
    small = grid({"max_pixels": 160 * 128})[0]
    assert small[1] * small[2] * 256 <= 160 * 128 < h * w * 256
    assert grid(None, {"max_pixels": 160 * 128})[0] == small
    with pytest.raises(EngineLimitError, match=r"messages\[0\]\.content\[0\]\.max_frames = 769 "
                                               "is above the deployment's limit of"):
        grid({"max_frames": 769})
    with pytest.raises(EngineLimitError, match="max_pixels = 2097153 is above the deployment's "
                                               "limit of 2097152 pixels per video frame"):
        grid({"max_pixels": 2097153})
