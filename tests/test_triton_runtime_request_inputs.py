"""Request parsing of the preprocessing model (qvl_trt/triton/runtime/request_inputs.py) and the word-list codec of the contract."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from qvl_trt.errors import InputError
from qvl_trt.generation_config import SamplingDefaults
from qvl_trt.mm.request import RequestBounds, RequestLimits
from qvl_trt.mm.video import VideoLimits
from qvl_trt.triton.runtime.request_inputs import UrlPolicy, chat_request

LIMITS = RequestLimits(max_images=2, max_input_len=512, max_seq_len=640)


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _parse(limits: RequestLimits = LIMITS, **inputs):
    return chat_request(inputs, urls=UrlPolicy(), defaults=SamplingDefaults(), limits=limits)


def test_messages_with_data_uri_images_and_the_text_form_agree() -> None:
    png = _png()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "What is it?"}]}]
    a = _parse(messages=json.dumps(messages).encode(), max_tokens=np.int32(5))
    b = _parse(text_input=b"What is it?", image_bytes=np.array([png], object),
               max_tokens=np.int32(5))
    assert a.images == b.images == (png,)
    assert a.settings == b.settings
    c_ = _parse(text_input=b"What is it?", image_bytes=np.array([uri.encode()], object))
    assert c_.images == (png,)


@pytest.mark.parametrize("inputs, message", [
    ({"messages": b"{not json"}, "messages is not valid JSON"),
    ({"messages": b"[]"}, "messages must be a non-empty list"),
    ({}, "neither messages nor text_input"),
    ({"text_input": b"hi", "max_tokens": np.int32(0)}, "max_tokens = 0 must be from 1 to"),
    ({"text_input": b"hi", "temperature": np.float32(-1)}, "temperature = -1.0 must be >= 0"),
    ({"text_input": b"hi", "top_p": np.float32(0)}, "top_p = 0.0 must be in (0, 1]"),
    # A number beyond float32 arrives as inf: said so, not "inf must be >= 0".
    ({"text_input": b"hi", "temperature": np.float32(np.inf)},
     "temperature = inf is not a finite number; send a number >= 0"),
    ({"text_input": b"hi", "min_tokens": np.int32(-2)}, "min_tokens = -2 must be from 0 to"),
    ({"text_input": b"hi", "max_tokens": np.int32(3), "min_tokens": np.int32(4)},
     "min_tokens = 4 is above max_tokens = 3"),
    ({"text_input": b"\xff"}, "text_input is not UTF-8"),
    ({"text_input": b"hi", "messages": b"[]"}, "send either messages, or text_input"),
    ({"text_input": b"hi", "top_k": np.int32(-1)}, "top_k = -1.0 must be >= 0"),
    ({"text_input": b"hi", "stop": np.array([b"ok", b""], object)}, "stop holds an empty"),
    ({"text_input": b"hi", "image_bytes": np.array([b"data:image/png;base64,@@"], object)},
     "invalid base64"),
    ({"text_input": b"hi", "image_bytes": np.array([b"https://example.com/a.png"], object)},
     "remote image URL on host 'example.com' refused"),
    ({"text_input": b"hi", "tools": b"[{"}, "tools is not valid JSON"),
    ({"text_input": b"hi", "tools": b'{"type": "function"}'}, "tools must be a JSON list"),
    ({"text_input": b"hi", "tools": b'[{"type": "retrieval"}]'},
     "tool 1 is not {type: function, function: {name, ...}}"),
    ({"text_input": b"hi", "tools": b'[{"type": "function", "function": {"name": ""}}]'},
     "tool 1 has no function name"),
    ({"text_input": b"hi",
      "tools": b'[{"type": "function", "function": {"name": "f", "parameters": 3}}]'},
     "tool 1 (f): parameters must be a JSON schema object"),
    ({"messages": json.dumps([{"role": "assistant", "content": None,
                               "tool_calls": [{"function": {"arguments": "{}"}}]}]).encode()},
     "message 1: tool call"),
    ({"messages": json.dumps([{"role": "assistant", "content": None,
                               "tool_calls": {"function": {}}}]).encode()},
     "message 1: tool_calls must be a list"),
    ({"messages": json.dumps([{"role": "assistant", "content": None}]).encode()},
     "message 1: content must be a string or a list of parts"),
    ({"text_input": b"hi", "guided_decoding_guide_type": b"json", "ignore_eos": np.bool_(True)},
     "a guided answer needs its end token"),
    ({"text_input": b"hi", "guided_decoding_guide_type": b"json", "min_tokens": np.int32(2)},
     "min_tokens with a guided answer"),
])
def test_bad_inputs_give_one_line_errors(inputs, message) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        _parse(**inputs)


def test_tools_reach_the_request_as_the_template_lists_them() -> None:
    """OpenAI's function tools, each reduced to Qwen's shape (type, name, description,
    parameters: what its template lists; `strict` is OpenAI's, not the model's)."""
    tool = {"type": "function", "function": {"name": "f", "description": "d", "strict": True,
                                             "parameters": {"type": "object"}}}
    req = _parse(messages=json.dumps([{"role": "user", "content": "hi"}]).encode(),
                 tools=json.dumps([tool]).encode())
    assert req.tools == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert _parse(text_input=b"hi").tools is None


def test_remote_images_come_only_from_allowed_hosts(tmp_path) -> None:
    """A real fetch from a local HTTP server whose host is on the allow-list; the same URL is
    refused without it, and a file larger than the limit is refused."""
    import functools
    import http.server
    import threading

    png = _png()
    (tmp_path / "cat.png").write_bytes(png)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        messages = json.dumps([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]).encode()
        allowed = UrlPolicy.from_parameter("example.com, 127.0.0.1")
        request = chat_request({"messages": messages}, urls=allowed, defaults=SamplingDefaults(),
                               limits=LIMITS)
        assert request.images == (png,)
        with pytest.raises(InputError, match="host '127.0.0.1' refused"):
            _parse(messages=messages)
        small = UrlPolicy(frozenset({"127.0.0.1"}), max_bytes=len(png) - 1)
        with pytest.raises(InputError, match="exceeds"):
            chat_request({"messages": messages}, urls=small, defaults=SamplingDefaults(),
                         limits=LIMITS)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_greedy_and_defaults() -> None:
    """A request without settings gets the defaults; the checkpoint's defaults
    (GenerationConfig.sampling_defaults) are tested in test_generation_config.py."""
    settings = _parse(text_input=b"x").settings
    assert (settings.temperature, settings.top_k, settings.stream) == (1.0, 0, False)
    greedy = chat_request({"text_input": b"x", "top_k": 5}, urls=UrlPolicy(),
                          defaults=SamplingDefaults(temperature=0.0), limits=LIMITS).settings
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 5, 1.0)
    assert (settings.min_tokens, settings.ignore_eos) == (0, False)
    fixed = _parse(text_input=b"x", max_tokens=np.int32(6), min_tokens=np.int32(6),
                   ignore_eos=np.bool_(True), temperature=np.float32(1e-45)).settings
    assert (fixed.max_tokens, fixed.min_tokens, fixed.ignore_eos) == (6, 6, True)
    assert fixed.temperature == float(np.float32(1e-45)) > 0  # subnormal: taken


# ---- bounds on the request's size and structure (mm.request.RequestBounds) -------------------

SMALL = RequestBounds(max_request_bytes=1000, max_messages=3, max_content_parts=4,
                      max_text_bytes=50, max_stop_words=2, max_stop_bytes=5)


def _chat(*contents) -> bytes:
    return json.dumps([{"role": "user", "content": c} for c in contents]).encode()


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


# bound -> inputs of a given size; each is sent at the limit (accepted) and one above it.
SIZED = {
    "max_request_bytes": lambda n: {"text_input": b"hi",
                                    "image_bytes": np.array([b"x" * (n - 2)], object)},
    "max_messages": lambda n: {"messages": _chat(*["hi"] * n)},
    "max_content_parts": lambda n: {"messages": _chat([_text_part("a")] * n)},
    # bytes, not characters: each "é" is two
    "max_text_bytes": lambda n: {"text_input": ("é" * (n // 2) + "e" * (n % 2)).encode()},
    "message text bytes": lambda n: {"messages": _chat([_text_part("e" * n)])},
    "max_stop_words": lambda n: {"text_input": b"hi", "stop": np.array([b"a"] * n, object)},
    "max_stop_bytes": lambda n: {"text_input": b"hi", "stop": np.array([b"e" * n], object)},
}
BOUND_OF = {"message text bytes": "max_text_bytes"}


@pytest.mark.parametrize("case", list(SIZED))
def test_each_bound_accepts_its_limit_and_names_itself_just_above(case) -> None:
    bound = BOUND_OF.get(case, case)
    limit = getattr(SMALL, bound)
    limits = RequestLimits(max_images=2, max_input_len=512, max_seq_len=640, bounds=SMALL)
    _parse(limits, **SIZED[case](limit))
    with pytest.raises(InputError) as refused:
        _parse(limits, **SIZED[case](limit + 1))
    message = str(refused.value)
    assert f"is {limit + 1}, above the limit of {limit}" in message
    assert f"preprocessing model's {bound} parameter" in message and "\n" not in message


def test_the_image_count_is_refused_before_any_image_is_fetched() -> None:
    """Three remote URLs on a host that is not allowed: the count (2) is what refuses them,
    so nothing was fetched; at the count the host check is what refuses."""
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(InputError, match="request has 3 images, the engine allows 2"):
        _parse(messages=_chat([part] * 3))
    with pytest.raises(InputError, match="host 'example.com' refused"):
        _parse(messages=_chat([part] * 2))
    with pytest.raises(InputError, match="request has 3 images, the engine allows 2"):
        _parse(text_input=b"hi", image_bytes=np.array([b"https://example.com/a.png"] * 3,
                                                      object))


def test_the_default_bounds_admit_a_full_request() -> None:
    """The defaults refuse none of the things the server tests send: two images of a few MB,
    a long chat, OpenAI's four stop strings."""
    limits = RequestLimits(max_images=2, max_input_len=512, max_seq_len=640)
    image = "data:image/png;base64," + base64.b64encode(b"x" * 4 * 2**20).decode()
    parts = [{"type": "image_url", "image_url": {"url": image}}] * 2 + [_text_part("x" * 4000)]
    request = _parse(limits, messages=_chat(*["hi"] * 100, parts),
                     stop=np.array([b"\n\n", b"User:", b"###", b"</s>"], object))
    assert len(request.images) == 2 and len(request.settings.stop) == 4


# ---- videos ---------------------------------------------------------------------------------

def test_video_parts_and_the_video_tensors_agree() -> None:
    """Each video form of messages (vLLM's video_url, qwen-vl-utils' video file and frame list,
    vLLM's video/jpeg frames) and its text_input twin give the same videos."""
    from qvl_trt.chat_messages import VideoFile, VideoFrames

    clip, frame = b"\x00\x00\x00\x18ftypisom-a-clip", _png()

    def uri(data: bytes, media: str) -> str:
        return f"data:{media};base64," + base64.b64encode(data).decode()

    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": uri(clip, "video/mp4")}, "fps": 1},
        {"type": "video", "video": [uri(frame, "image/png")] * 3, "sample_fps": 4},
        {"type": "video", "video": uri(clip, "video/webm")},
        {"type": "video", "video": [uri(frame, "image/png")] * 2, "timestamps": [0, 0.5]},
        {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(
            [base64.b64encode(frame).decode()] * 2)}},
        {"type": "text", "text": "What happens?"}]}]
    limits = RequestLimits(max_images=2, max_input_len=512, max_seq_len=640,
                           video=VideoLimits(max_videos=5))
    parsed = _parse(limits, messages=json.dumps(messages).encode())
    assert parsed.videos == (VideoFile(clip, 1.0), VideoFrames((frame,) * 3, 4.0),
                             VideoFile(clip), VideoFrames((frame,) * 2, None, (0.0, 0.5)),
                             VideoFrames((frame,) * 2))
    plain = _parse(limits, text_input=b"What happens?",
                   video_bytes=np.array([clip, uri(clip, "video/mp4").encode()], object),
                   video_frames=np.array([frame] * 5, object),
                   video_frame_counts=np.array([3, 2], np.int32),
                   video_fps=np.array([1, 2, 4, 8], np.float32))
    assert plain.videos == (VideoFile(clip, 1.0), VideoFile(clip, 2.0),
                            VideoFrames((frame,) * 3, 4.0), VideoFrames((frame,) * 2, 8.0))
    assert plain.messages.template[0]["content"] == [{"type": "video"}] * 4 + [
        {"type": "text", "text": "What happens?"}]
    one_rate = _parse(limits, text_input=b"x", video_frames=np.array([frame] * 2, object),
                      video_fps=np.array([3], np.float32))
    assert one_rate.videos == (VideoFrames((frame,) * 2, 3.0),)


@pytest.mark.parametrize("inputs, message", [
    ({"video_fps": np.array([0], np.float32)}, "video_fps = 0.0 must be a finite number"),
    ({"video_fps": np.array([np.nan], np.float32)}, "video_fps = nan must be a finite number"),
    ({"video_fps": np.array([1, 2, 3], np.float32)}, "video_fps holds 3 values for 2 videos"),
    ({"video_frame_counts": np.array([1, 2], np.int32)}, "do not split the 2 video_frames"),
    ({"video_bytes": np.array([b"https://example.com/a.mp4"], object)},
     "remote video URL on host 'example.com' refused"),
    ({"video_bytes": np.array([b"data:video/mp4;base64,@@"], object)},
     "a video data URI holds invalid base64"),
])
def test_bad_video_tensors_are_refused(inputs, message: str) -> None:
    base = {"text_input": b"hi", "video_bytes": np.array([b"clip"], object),
            "video_frames": np.array([_png(), _png()], object)}
    with pytest.raises(InputError, match=re.escape(message)):
        _parse(**{**base, **inputs})


@pytest.mark.parametrize("part, message", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}, "fps": 0},
     "fps = 0 must be a finite number"),
    ({"type": "video", "video": "data:video/mp4;base64,AAAA", "fps": "fast"},
     "fps = 'fast' must be a number"),
    ({"type": "video", "video": ["data:image/png;base64,AAAA"], "fps": 2, "sample_fps": 3},
     "gives fps 2 and sample_fps 3; send one of them"),
    ({"type": "video", "video": "data:video/mp4;base64,AAAA", "timestamps": [0, 1]},
     "timestamps are for a video sent as frames"),
    ({"type": "video", "video": ["data:image/png;base64,AAAA"], "timestamps": "soon"},
     "timestamps must be a list of numbers"),
    ({"type": "video_url", "video_url": {}}, "has no URL or frame list"),
])
def test_bad_video_parts_are_refused(part, message: str) -> None:
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]
    with pytest.raises(InputError, match=re.escape(message)):
        _parse(messages=json.dumps(messages).encode())


def test_video_tensors_count_towards_the_request_size() -> None:
    limits = RequestLimits(max_images=2, max_input_len=512, max_seq_len=640,
                           bounds=RequestBounds(max_request_bytes=100))
    with pytest.raises(InputError, match="max_request_bytes"):
        _parse(limits, text_input=b"hi", video_bytes=np.array([b"v" * 101], object))
    with pytest.raises(InputError, match="send either messages, or text_input"):
        _parse(messages=b"[]", video_frames=np.array([b"f"], object))


# ---- what the preprocessing step makes of the settings ---------------------------------------

@pytest.fixture(scope="module")
def step(tmp_path_factory, tiny_build, tiny_ckpt):
    """The preprocessing step of the tiny build's reference repository, in this process. The
    repository records the checkpoint's name."""
    from qvl_trt.triton import contract as c
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.pbconfig import read_config
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    repo = write_repo([BuildInput(tiny_build)], tmp_path_factory.mktemp("repo") / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path
    params = c.PreprocessingParameters.from_parameters(
        {k: v.string_value for k, v in read_config(repo / "preprocessing").parameters.items()})
    assert params.checkpoint_name == tiny_ckpt.name
    # The build by content, which the gateway's answer cache keys answers by.
    assert params.cache_key == json.loads((tiny_build / "manifest.json").read_text())[
        "cache_key"]
    return Preprocessor(tiny_ckpt, params)


def test_preprocessing_sends_min_tokens_no_end_id_and_greedy_as_tensorrt_llm_reads_them(
        step, tiny_ckpt) -> None:
    """ignore_eos: end_id -1 (no end id) and no other end id among the stop words, min_tokens
    0 (nothing to hold back); min_tokens alone travels as it is; a temperature that scales as 0
    does is greedy."""
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.triton import contract as c

    end_ids = open_checkpoint(tiny_ckpt).generation.end_ids
    assert len(end_ids) == 2  # one end_id, one more as a one-token stop word

    def sent(**settings):
        out = step({"text_input": b"Hi", "max_tokens": np.int32(4), **settings})
        words = c.word_list_sequences(out[c.STOP_WORDS_LIST])
        return int(out[c.END_ID][0]), int(out[c.MIN_TOKENS][0]), words, out

    assert sent()[:3] == (end_ids[0], 0, [[end_ids[1]]])
    assert sent(min_tokens=np.int32(3))[:3] == (end_ids[0], 3, [[end_ids[1]]])
    assert sent(min_tokens=np.int32(4), ignore_eos=np.bool_(True))[:3] == (c.NO_END_ID, 0, [])
    for tiny in (1e-40, 1e-45):
        out = sent(temperature=np.float32(tiny))[3]
        assert (out[c.RUNTIME_TOP_K][0], out[c.TEMPERATURE][0]) == (1, 1.0)
    with pytest.raises(InputError, match="min_tokens = 9 is above max_tokens = 4"):
        step({"text_input": b"Hi", "max_tokens": np.int32(4), "min_tokens": np.int32(9)})
    with pytest.raises(InputError, match="the deployment's default where max_tokens is left"):
        step({"text_input": b"Hi", "min_tokens": np.int32(10**6)})


def test_a_request_s_messages_are_checked_once(step, monkeypatch) -> None:
    """Through the preprocessing step, chat messages (with an image part) and the text form
    each pass the message bounds and the walk of their parts once: the intake's check is the
    one later steps rely on."""
    from qvl_trt import chat_messages
    from qvl_trt.mm import chat, request
    from qvl_trt.triton import contract as c

    calls = []

    def counted(real):
        def wrapper(*args, **kwargs):
            calls.append(real.__name__)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(request.RequestLimits, "check_messages",
                        counted(request.RequestLimits.check_messages))
    # Each module calls read_messages through its own name: patch it where it is looked up.
    for module in (request, chat):
        monkeypatch.setattr(module, "read_messages", counted(chat_messages.read_messages))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                 base64.b64encode(_png()).decode()}}
    chat = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    for inputs in ({c.MESSAGES: json.dumps(chat).encode()},
                   {c.TEXT_INPUT: b"Hi", c.IMAGE_BYTES: np.array([_png()], object)}):
        calls.clear()
        out = step({**inputs, c.MAX_TOKENS: np.int32(2)})
        assert out[c.IMAGE_GRID_THW].shape[0] == 1
        assert calls == ["check_messages", "read_messages"]
