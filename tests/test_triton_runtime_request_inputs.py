"""Request parsing of the preprocessing model (qvl_trt/triton/runtime/request_inputs.py) and the word-list codec of the contract."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from qvl_trt.errors import InputError
from qvl_trt.generation_config import SamplingDefaults
from qvl_trt.mm.request import RequestBounds, RequestLimits
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
    ({"messages": b"[]"}, "non-empty JSON list"),
    ({}, "neither messages nor text_input"),
    ({"text_input": b"hi", "max_tokens": np.int32(0)}, "max_tokens = 0 must be at least 1"),
    ({"text_input": b"hi", "temperature": np.float32(-1)}, "temperature = -1.0 must be >= 0"),
    ({"text_input": b"hi", "top_p": np.float32(0)}, "top_p = 0.0 must be in (0, 1]"),
    ({"text_input": b"\xff"}, "text_input is not UTF-8"),
    ({"text_input": b"hi", "messages": b"[]"}, "send either messages, or text_input"),
    ({"text_input": b"hi", "top_k": np.int32(-1)}, "top_k = -1.0 must be >= 0"),
    ({"text_input": b"hi", "stop": np.array([b"ok", b""], object)}, "stop holds an empty"),
    ({"text_input": b"hi", "image_bytes": np.array([b"data:image/png;base64,@@"], object)},
     "invalid base64"),
    ({"text_input": b"hi", "image_bytes": np.array([b"https://example.com/a.png"], object)},
     "remote image URL on host 'example.com' refused"),
])
def test_bad_inputs_give_one_line_errors(inputs, message) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        _parse(**inputs)


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
