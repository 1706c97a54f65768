"""The ensemble's public inputs -> a chat request: messages, image bytes, generation settings.

Two request forms: `messages` (OpenAI-style chat JSON whose image parts carry the image as a
base64 data URI of any supported format) or `text_input` with zero or more `image_bytes`
(encoded files, or data URIs). Remote image URLs are fetched only from hosts on the
deployment's allow-list; by default the server fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InputError
from ...generation_config import SamplingDefaults
from ...mm.chat import IMAGE_PART_TYPES, user_message
from ...mm.request import RequestBounds, RequestLimits


@dataclass(frozen=True)
class UrlPolicy:
    """Which remote image URLs may be fetched: https/http URLs whose host is listed."""

    allowed_hosts: frozenset[str] = frozenset()
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0

    @classmethod
    def from_parameter(cls, value: str, **kwargs: Any) -> UrlPolicy:
        """From a comma-separated host list (the `image_url_allow_list` parameter)."""
        hosts = frozenset(h.strip().lower() for h in value.split(",") if h.strip())
        return cls(hosts, **kwargs)


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int | None  # None: the deployment's default
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int | None
    stop: tuple[str, ...]
    stream: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    images: tuple[bytes, ...]  # in order of the image parts
    settings: GenerationSettings


def chat_request(inputs: Mapping[str, Any], *, urls: UrlPolicy, defaults: SamplingDefaults,
                 limits: RequestLimits) -> ChatRequest:
    """`inputs`: public input name -> value (one batch row, scalars unwrapped; absent inputs
    missing); `defaults`: the checkpoint's (Checkpoint.generation.sampling_defaults()).
    The request's size and structure are checked (limits.bounds, the image count) before
    any image is fetched or decoded. Raises InputError naming the input and the fix."""
    bounds = limits.bounds
    messages_raw = inputs.get("messages")
    text = inputs.get("text_input")
    image_list = _items(inputs.get("image_bytes"))
    sent = sum(_size(v) for v in (messages_raw, text, *image_list, *_items(inputs.get("stop"))))
    bounds.check("the request's size in bytes (messages, text_input, image_bytes, stop)", sent,
                 "max_request_bytes", "send smaller or fewer images")
    if messages_raw is not None:
        if text is not None or image_list:
            raise InputError("send either messages, or text_input with image_bytes, not both")
        messages = _parse_messages(messages_raw)
        limits.check_messages(messages)
        images = tuple(_image_from_part(part, urls) for part in _image_parts(messages))
    elif text is not None:
        prompt = _utf8(text, "text_input")
        messages = user_message(prompt, len(image_list))
        limits.check_messages(messages)
        images = tuple(_image_from_element(item, n, urls) for n, item in
                       enumerate(image_list, 1))
    else:
        raise InputError("the request has neither messages nor text_input; send one of them")
    return ChatRequest(messages, images, _settings(inputs, defaults, bounds))


def _size(value: Any) -> int:
    """Bytes of one BYTES element (absent: 0)."""
    if value is None:
        return 0
    return len(value.encode()) if isinstance(value, str) else memoryview(value).nbytes


def _items(value: Any) -> list[Any]:
    """The elements of a [-1]-shaped input (absent: none)."""
    return [] if value is None else list(value)


def _utf8(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "send UTF-8") from None


def _parse_messages(raw: Any) -> list[dict[str, Any]]:
    try:
        messages = json.loads(_utf8(raw, "messages"))
    except json.JSONDecodeError as exc:
        raise InputError(f"messages is not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}); send a JSON list of {{role, content}} objects") from None
    if isinstance(messages, Mapping) and "messages" in messages:
        messages = messages["messages"]  # a whole chat-completions body is accepted too
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty JSON list of {role, content} objects")
    return messages


def _image_parts(messages: Sequence[Any]) -> list[Mapping[str, Any]]:
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts += [p for p in content
                      if isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES]
    return parts


def _image_from_part(part: Mapping[str, Any], urls: UrlPolicy) -> bytes:
    """{type: image_url, image_url: {url}} | {type: image_url, image_url: url} |
    {type: image, image: url-or-data-uri}."""
    source = part.get("image_url", part.get("image"))
    if isinstance(source, Mapping):
        source = source.get("url")
    if not isinstance(source, str) or not source:
        raise InputError(f"image part {repr(dict(part))[:80]} has no URL; put the image in it "
                         "as a data URI (data:image/png;base64,...)")
    return _image_from_url(source, urls)


def _image_from_element(item: Any, number: int, urls: UrlPolicy) -> bytes:
    data = bytes(item)
    if data[:8].lower().startswith((b"data:", b"https://", b"http://")):
        return _image_from_url(_utf8(data, f"image_bytes[{number}]"), urls)
    return data


def _image_from_url(url: str, urls: UrlPolicy) -> bytes:
    if url[:5].lower() == "data:":
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise InputError("an image data URI must be base64: data:image/<format>;base64,...")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InputError("an image data URI holds invalid base64; encode the file again") \
                from None
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise InputError(f"image URL scheme {parsed.scheme or '(none)'!r} is not supported; "
                         "send a data URI or an https URL")
    host = (parsed.hostname or "").lower()
    if host not in urls.allowed_hosts:
        raise InputError(f"remote image URL on host {host!r} refused: this server fetches no "
                         "remote images unless its host is on the image_url_allow_list "
                         "parameter; send the image as a data URI instead")
    return _fetch(url, urls)


def _fetch(url: str, urls: UrlPolicy) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=urls.timeout_s) as response:
            data = response.read(urls.max_bytes + 1)
    except OSError as exc:
        raise InputError(f"fetching image {url} failed ({exc}); check the URL") from None
    if len(data) > urls.max_bytes:
        raise InputError(f"image at {url} exceeds {urls.max_bytes} bytes; send a smaller one")
    return data


def _settings(inputs: Mapping[str, Any], defaults: SamplingDefaults,
              bounds: RequestBounds) -> GenerationSettings:
    def number(name: str, default: float, ok, what: str) -> float:
        value = inputs.get(name)
        if value is None:
            return default
        value = float(value)
        if not (math.isfinite(value) and ok(value)):
            raise InputError(f"{name} = {value} must be {what}")
        return value

    max_tokens = inputs.get("max_tokens")
    if max_tokens is not None:
        max_tokens = int(max_tokens)
        if max_tokens <= 0:
            raise InputError(f"max_tokens = {max_tokens} must be at least 1")
    stop = tuple(_utf8(s, "stop") for s in _items(inputs.get("stop")))
    bounds.check("the number of stop strings", len(stop), "max_stop_words",
                 "send fewer stop strings")
    for word in stop:
        if not word:
            raise InputError("stop holds an empty string; leave it out")
        bounds.check("the UTF-8 size of a stop string", len(word.encode()), "max_stop_bytes",
                     "send a shorter stop string")
    seed = inputs.get("seed")
    return GenerationSettings(
        max_tokens=max_tokens,
        temperature=number("temperature", defaults.temperature, lambda v: v >= 0, ">= 0"),
        top_p=number("top_p", defaults.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=int(number("top_k", defaults.top_k, lambda v: v >= 0, ">= 0 (0 = off)")),
        seed=None if seed is None else int(seed),
        stop=stop,
        stream=bool(inputs.get("stream", False)),
    )
