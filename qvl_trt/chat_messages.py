"""A request's chat messages and their content parts, from the wire to the prompt: the roles
and part types (OpenAI's, vLLM's and qwen-vl-utils'), the one walk that checks them and
reduces them to what the chat template reads (`read_messages`), and the data of their image
and video parts (data URIs decoded here; a remote URL through the fetch the server hands in);
and OpenAI's rules for the turns of a tool exchange, which the gateway holds requests to.

Messages are `{"role": ..., "content": str | [part, ...]}` with parts `{"type": "text",
"text": ...}`, `{"type": "image"}` / `{"type": "image_url", "image_url": {"url"} | url}` and
`{"type": "video"}` / `{"type": "video_url", ...}` (docs/triton.md); an assistant turn may
carry `tool_calls`. Each image or video part may carry its visual budget (`ImageBudget`,
`VideoBudget`: OpenAI's `image_url.detail`, qwen-vl-utils' part fields), and a request may
give budgets for all its parts (vLLM's `mm_processor_kwargs`); mm/request.py resolves them
against the deployment's limits.

Standard library only, so that both sides use it: the gateway counts a request's image and
video parts to pick a build (gateway/routing.py) without loading the server side, which
bounds the messages (mm/request.py), renders them (mm/chat.py) and reads the ensemble's
inputs with it (triton/runtime/request_inputs.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import FieldError, InputError

if TYPE_CHECKING:
    from PIL import Image

ROLES = ("system", "user", "assistant", "tool")
# What messages must be, in a refusal's words (the gateway checks the same at the edge).
MESSAGES_SHAPE = "messages must be a non-empty list of {role, content} objects"
IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")

# The server's fetch of a remote URL (url, "image" or "video") -> the file's bytes; it
# refuses what its deployment does not allow (triton/runtime/request_inputs.py UrlPolicy).
Fetch = Callable[[str, str], bytes]


@dataclass(frozen=True)
class VideoFile:
    data: bytes  # the whole file
    fps: float | None = None  # sampling rate; None: the checkpoint's


@dataclass(frozen=True)
class VideoFrames:
    frames: tuple[bytes | Image.Image, ...]  # encoded images (as image inputs) or PIL images
    fps: float | None = None  # the rate they were taken at; None: 2
    timestamps: tuple[float, ...] | None = None  # or each frame's seconds


VideoInput = VideoFile | VideoFrames


# ---- per-request visual budgets ----------------------------------------------------------
# OpenAI's image_url.detail: low a small fixed budget, high the deployment's whole budget, auto
# (and absent) the deployment's default (mm/request.py `image_bounds` says what each is).
DETAILS = ("low", "high", "auto")
# qwen-vl-utils' fields of a part, and vLLM's mm_processor_kwargs keys for every part of the
# request: an image's pixel bounds; a video's sampling rate, frames and pixels per frame.
IMAGE_BUDGET_FIELDS = ("min_pixels", "max_pixels")
VIDEO_BUDGET_FIELDS = ("fps", "max_frames", "max_pixels")
MM_PROCESSOR_KWARGS = "mm_processor_kwargs"


@dataclass(frozen=True)
class ImageBudget:
    """One image's budget as the request gives it (None: the deployment's); `where`: the part's
    path, for refusals."""

    detail: str = "auto"
    min_pixels: int | None = None
    max_pixels: int | None = None
    where: str = ""


@dataclass(frozen=True)
class VideoBudget:
    """One video's budget as the request gives it (None: the deployment's): frames sampled per
    second, frames at most, pixels of one resized frame at most."""

    fps: float | None = None
    max_frames: int | None = None
    max_pixels: int | None = None
    where: str = ""


@dataclass(frozen=True)
class CheckedMessages:
    """Messages that `read_messages` checked (once per request: later steps take this and do
    not walk them again): as the template reads them (image and video data left out), and
    their image and video parts as sent with each one's budget, each in order of
    appearance."""

    template: list[dict[str, Any]]
    image_parts: tuple[Mapping[str, Any], ...] = ()
    video_parts: tuple[Mapping[str, Any], ...] = ()
    image_budgets: tuple[ImageBudget, ...] = ()
    video_budgets: tuple[VideoBudget, ...] = ()

    def images(self, fetch: Fetch) -> tuple[bytes, ...]:
        """The image parts' files (`fetch`: for a remote URL)."""
        return tuple(_image_from_part(part, fetch) for part in self.image_parts)

    def videos(self, fetch: Fetch) -> tuple[VideoInput, ...]:
        """The video parts' files or frames, each sampled at its budget's rate."""
        return tuple(_video_from_part(part, fetch, budget.fps)
                     for part, budget in zip(self.video_parts, self.video_budgets, strict=True))


def user_message(prompt: str, image_count: int, video_count: int = 0) -> list[dict[str, Any]]:
    """One user turn: the images, the videos, then the text (Qwen's own examples' order)."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(image_count)]
    parts += [{"type": "video"} for _ in range(video_count)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


def media_counts(messages: Sequence[Any]) -> tuple[int, int]:
    """(image parts, video parts) of chat messages as sent; what is not a message or a part
    counts as neither (read_messages refuses it)."""
    images = videos = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            images += kind in IMAGE_PART_TYPES
            videos += kind in VIDEO_PART_TYPES
    return images, videos


def read_messages(messages: Sequence[Mapping[str, Any]],
                  mm_processor_kwargs: Mapping[str, Any] | None = None) -> CheckedMessages:
    """Refuse malformed messages (roles, parts, images or videos outside user turns, budgets)
    before any of their images or videos is fetched or decoded; else what the template reads
    and the image and video parts with their budgets (`mm_processor_kwargs`: the budget of
    every part that gives none of its own)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError(MESSAGES_SHAPE)
    defaults = check_mm_processor_kwargs(mm_processor_kwargs)
    clean: list[dict[str, Any]] = []
    images: list[Mapping[str, Any]] = []
    videos: list[Mapping[str, Any]] = []
    image_budgets: list[ImageBudget] = []
    video_budgets: list[VideoBudget] = []
    for n, message in enumerate(messages, 1):
        if not isinstance(message, Mapping):
            raise InputError(f"message {n} is a {type(message).__name__}, not an object "
                             "with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InputError(f"message {n} has role {role!r}; use one of {', '.join(ROLES)}")
        calls = _tool_calls(message, n) if role == "assistant" else {}
        if content is None and calls:  # an assistant turn that only called functions
            content = ""
        if isinstance(content, str):
            clean.append({"role": role, "content": content, **calls})
            continue
        if not isinstance(content, Sequence) or isinstance(content, bytes):
            raise InputError(f"message {n}: content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            where = f"messages[{n - 1}].content[{j}]"
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                if role != "user":
                    raise InputError(f"message {n}: images go in user messages, not {role}")
                parts.append({"type": "image"})
                images.append(part)
                image_budgets.append(image_budget(part, where, defaults))
            elif kind in VIDEO_PART_TYPES:
                if role != "user":
                    raise InputError(f"message {n}: videos go in user messages, not {role}; "
                                     "move the video to a user turn")
                parts.append({"type": "video"})
                videos.append(part)
                video_budgets.append(video_budget(part, where, defaults))
            else:
                raise InputError(f"message {n}: content part {repr(part)[:60]} is neither "
                                 "{type: text, text: ...}, {type: image} nor {type: video}")
        clean.append({"role": role, "content": parts, **calls})
    return CheckedMessages(clean, tuple(images), tuple(videos), tuple(image_budgets),
                           tuple(video_budgets))


def image_part(url: str, budget: ImageBudget = ImageBudget()) -> dict[str, Any]:
    """An image_url part of `url` at `budget`, in the fields `image_budget` reads back."""
    source = {"url": url} | ({} if budget.detail == "auto" else {"detail": budget.detail})
    return {"type": "image_url", "image_url": source,
            **{key: getattr(budget, key) for key in IMAGE_BUDGET_FIELDS
               if getattr(budget, key) is not None}}


def parse_image_budget(text: str) -> ImageBudget:
    """A budget as a command line spells it: a detail (low, high, auto) or pixel bounds
    joined by ':' (max_pixels=262144, min_pixels=65536:max_pixels=262144)."""
    if text in DETAILS:
        return ImageBudget(text, where=text)
    fields: dict[str, Any] = {}
    for item in text.split(":"):
        key, sep, value = item.partition("=")
        if not sep or key not in IMAGE_BUDGET_FIELDS or not value.isdigit():
            raise InputError(f"budget {text!r}: expected {', '.join(DETAILS)} or "
                             f"{'=N:'.join(IMAGE_BUDGET_FIELDS)}=N (either or both)")
        fields[key] = int(value)
    return image_budget({"type": "image_url", **fields}, text, {})


def check_mm_processor_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's request-wide `mm_processor_kwargs`, checked (FieldError naming the key): the
    budget fields of images and videos, nothing else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise FieldError(f"{MM_PROCESSOR_KWARGS} must be an object, e.g. "
                         '{"max_pixels": 262144}', MM_PROCESSOR_KWARGS)
    known = dict.fromkeys((*IMAGE_BUDGET_FIELDS, *VIDEO_BUDGET_FIELDS))
    for key in kwargs:
        if key not in known:
            raise FieldError(f"{MM_PROCESSOR_KWARGS}.{key} is not supported: this server takes "
                             f"{', '.join(known)}; leave it out", f"{MM_PROCESSOR_KWARGS}.{key}")
    return {key: _budget_number(key, value, f"{MM_PROCESSOR_KWARGS}.{key}")
            for key, value in kwargs.items() if value is not None}


def check_budgets(messages: Sequence[Any], kwargs: Mapping[str, Any] | None) -> None:
    """The budgets of messages as sent (the gateway refuses a bad one at the edge, naming its
    field; read_messages reads them with the rest)."""
    defaults = check_mm_processor_kwargs(kwargs)
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PART_TYPES:
                image_budget(part, f"messages[{i}].content[{j}]", defaults)
            elif kind in VIDEO_PART_TYPES:
                video_budget(part, f"messages[{i}].content[{j}]", defaults)


def image_budget(part: Mapping[str, Any], where: str, defaults: Mapping[str, Any]) \
        -> ImageBudget:
    """An image part's budget: its detail or its own pixel bounds, else the request's."""
    source = part.get("image_url")
    detail = source.get("detail") if isinstance(source, Mapping) else None
    if detail is not None and detail not in DETAILS:
        raise FieldError(f"{where}.image_url.detail = {json.dumps(detail)[:40]} is not one of "
                         f"{', '.join(DETAILS)}; send one of them or leave it out",
                         f"{where}.image_url.detail")
    own = {key: _budget_number(key, part[key], f"{where}.{key}")
           for key in IMAGE_BUDGET_FIELDS if part.get(key) is not None}
    if own and detail not in (None, "auto"):
        key = next(iter(own))
        raise FieldError(f"{where} gives both image_url.detail {detail!r} and {key}: each sets "
                         "the image's budget; send one of them", f"{where}.{key}")
    if detail in ("low", "high"):  # the part's detail replaces the request's pixel bounds
        return ImageBudget(detail, where=where)
    bounds = {key: own.get(key, defaults.get(key)) for key in IMAGE_BUDGET_FIELDS}
    if None not in bounds.values() and bounds["min_pixels"] > bounds["max_pixels"]:
        raise FieldError(f"{where}: min_pixels {bounds['min_pixels']} is above max_pixels "
                         f"{bounds['max_pixels']}; send min_pixels <= max_pixels",
                         f"{where}.min_pixels")
    return ImageBudget("auto", **bounds, where=where)


def video_budget(part: Mapping[str, Any], where: str, defaults: Mapping[str, Any]) \
        -> VideoBudget:
    """A video part's budget: its own fields (fps or sample_fps), else the request's."""
    own = {key: _budget_number(key, part[key], f"{where}.{key}")
           for key in VIDEO_BUDGET_FIELDS[1:] if part.get(key) is not None}
    fps = _part_fps(part)
    if fps is None and part.get("timestamps") is None:  # frames with their times take no rate
        fps = defaults.get("fps")
    return VideoBudget(fps,
                       *(own.get(key, defaults.get(key)) for key in VIDEO_BUDGET_FIELDS[1:]),
                       where=where)


def _budget_number(key: str, value: Any, field: str) -> Any:
    """A budget field's value: fps a positive number, the others a positive integer."""
    if key == "fps":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise FieldError(f"{field} = {json.dumps(value)[:40]} must be a number of frames per "
                             "second above 0; send e.g. 2", field)
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FieldError(f"{field} = {json.dumps(value)[:40]} must be a positive integer", field)
    return value


def _tool_calls(message: Mapping[str, Any], n: int) -> dict[str, Any]:
    """An assistant message's `tool_calls` as the template reads them ({} for none): each
    rendered as Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the
    arguments as sent (OpenAI's JSON text, or an object)."""
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return {}
    if not isinstance(calls, list):
        raise InputError(f"message {n}: tool_calls must be a list of {{id, type: function, "
                         "function: {name, arguments}}}")
    clean = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments", "{}") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, Mapping)):
            raise InputError(f"message {n}: tool call {repr(call)[:60]} is not {{type: "
                             "function, function: {name, arguments}}}")
        clean.append({"function": {"name": name, "arguments": arguments}})
    return {"tool_calls": clean}


def check_tool_turns(messages: Sequence[Any]) -> None:
    """OpenAI's rules for the turns of a tool exchange, which the gateway holds its requests
    to (read_messages checks the rest of each message; a FieldError names the field): an
    assistant's tool call has an id and its arguments as JSON text, and a tool message
    answers, by tool_call_id, a call made earlier in the conversation."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        where = f"messages[{i}]"
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            at = f"{where}.tool_calls[{j}]"
            ident = call.get("id") if isinstance(call, Mapping) else None
            if not isinstance(ident, str) or not ident:
                raise FieldError(f"{at}.id is missing: each tool call has the id its tool "
                                 "message answers; send the id the call came with", f"{at}.id")
            function = call.get("function")
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            if not isinstance(arguments, str):
                raise FieldError(f"{at}.function.arguments must be a string of JSON, got "
                                 f"{json.dumps(arguments)[:40]}; send json.dumps of the "
                                 "arguments", f"{at}.function.arguments")
            called.add(ident)
        if message.get("role") == "tool":
            ident = message.get("tool_call_id")
            if not isinstance(ident, str) or not ident:
                raise FieldError(f"{where}.tool_call_id is missing: a tool message answers "
                                 "one tool call of an earlier assistant message; send its id",
                                 f"{where}.tool_call_id")
            if ident not in called:
                raise FieldError(f"{where}.tool_call_id {ident[:40]!r} answers no tool call "
                                 "of an earlier assistant message; send the id of one",
                                 f"{where}.tool_call_id")


# ---- the image and video parts' data ---------------------------------------------------------

def _image_from_part(part: Mapping[str, Any], fetch: Fetch) -> bytes:
    """{type: image_url, image_url: {url}} | {type: image_url, image_url: url} |
    {type: image, image: url-or-data-uri}."""
    source = part.get("image_url", part.get("image"))
    if isinstance(source, Mapping):
        source = source.get("url")
    if not isinstance(source, str) or not source:
        raise InputError(f"image part {repr(dict(part))[:80]} has no URL; put the image in it "
                         "as a data URI (data:image/png;base64,...)")
    return media_from_url(source, "image", fetch)


def _video_from_part(part: Mapping[str, Any], fetch: Fetch, fps: float | None) -> VideoInput:
    """{type: video_url, video_url: {url} | url} | {type: video, video: url | [frame urls]},
    each with an optional fps (sample_fps; `fps`: its budget's, the part's or the request's);
    a frame list may give timestamps instead."""
    source = part.get("video_url", part.get("video"))
    if isinstance(source, Mapping):
        source = source.get("url")
    timestamps = part.get("timestamps")
    if isinstance(source, list) and source and all(isinstance(f, str) for f in source):
        return VideoFrames(tuple(media_from_url(f, "image", fetch) for f in source), fps,
                           None if timestamps is None else _timestamps(timestamps))
    if not isinstance(source, str) or not source:
        raise InputError(f"video part {repr(dict(part))[:80]} has no URL or frame list; put the "
                         "video in it as a data URI (data:video/mp4;base64,...)")
    if timestamps is not None:
        raise InputError("timestamps are for a video sent as frames; a video file's frames are "
                         "timed by the file: leave timestamps out")
    header = source[:64].lower()
    if header.startswith("data:video/jpeg;base64,"):  # vLLM: base64 JPEG frames, comma-separated
        payloads = source.partition(",")[2].split(",")
        return VideoFrames(tuple(_decode_base64(p, "video") for p in payloads), fps)
    return VideoFile(media_from_url(source, "video", fetch), fps)


def check_fps(fps: float, what: str) -> float:
    value = float(fps)
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{what} = {fps} must be a finite number of frames per second above 0; "
                         "send e.g. 2")
    return value


def _part_fps(part: Mapping[str, Any]) -> float | None:
    rates = {key: part[key] for key in ("fps", "sample_fps") if part.get(key) is not None}
    if len(set(map(repr, rates.values()))) > 1:
        raise InputError(f"the video part gives fps {rates['fps']} and sample_fps "
                         f"{rates['sample_fps']}; send one of them")
    for key, value in rates.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{key} = {value!r} must be a number of frames per second; send "
                             "e.g. 2")
        return check_fps(value, key)
    return None


def _timestamps(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in value):
        raise InputError("timestamps must be a list of numbers (seconds), one per frame")
    return tuple(float(t) for t in value)


def media_from_url(url: str, kind: str, fetch: Fetch) -> bytes:
    """A data URI's bytes, or what `fetch` brings of a remote URL; `kind`: image or video."""
    if url[:5].lower() != "data:":
        return fetch(url, kind)
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise InputError(f"{_article(kind)} data URI must be base64: "
                         f"data:{kind}/<format>;base64,...")
    return _decode_base64(payload, kind)


def _decode_base64(payload: str, kind: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{_article(kind)} data URI holds invalid base64; encode the file "
                         "again") from None


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
