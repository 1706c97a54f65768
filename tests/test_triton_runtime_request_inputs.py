"""Request parsing of the preprocessing model (qvl_trt/triton/runtime/request_inputs.py) and the word-list codec of the contract."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from qvl_trt.errors import InputError
from qvl_trt.generation_config import SamplingDefaults
from qvl_trt.triton.runtime.request_inputs import UrlPolicy, chat_request


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _parse(**inputs):
    return chat_request(inputs, urls=UrlPolicy(), defaults=SamplingDefaults())


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
        request = chat_request({"messages": messages}, urls=allowed, defaults=SamplingDefaults())
        assert request.images == (png,)
        with pytest.raises(InputError, match="host '127.0.0.1' refused"):
            _parse(messages=messages)
        small = UrlPolicy(frozenset({"127.0.0.1"}), max_bytes=len(png) - 1)
        with pytest.raises(InputError, match="exceeds"):
            chat_request({"messages": messages}, urls=small, defaults=SamplingDefaults())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_greedy_and_defaults() -> None:
    """A request without settings gets the defaults; the checkpoint's defaults
    (GenerationConfig.sampling_defaults) are tested in test_generation_config.py."""
    settings = _parse(text_input=b"x").settings
    assert (settings.temperature, settings.top_k, settings.stream) == (1.0, 0, False)
    greedy = chat_request({"text_input": b"x", "top_k": 5}, urls=UrlPolicy(),
                          defaults=SamplingDefaults(temperature=0.0)).settings
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 5, 1.0)
