"""The ensemble's public inputs -> a chat request: messages, image and video data, generation
settings.

Two request forms: `messages` (OpenAI-style chat JSON whose image and video parts carry the
data as base64 data URIs; video parts as vLLM's and qwen-vl-utils': docs/triton.md) or
`text_input` with zero or more `image_bytes`, `video_bytes` and `video_frames` (encoded files,
or data URIs). Either form's messages are checked here, once per request (chat_messages.py
walks them and decodes their parts); later steps take the checked messages. Remote image and
video URLs are fetched only from hosts on the deployment's allow-list (`UrlPolicy.fetch`); by
default the server fetches nothing.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...chat_messages import (
    MESSAGES_SHAPE,
    MM_PROCESSOR_KWARGS,
    CheckedMessages,
    VideoFile,
    VideoFrames,
    VideoInput,
    check_fps,
    media_from_url,
    user_message,
)
from ...errors import InputError
from ...generation_config import SamplingDefaults
from ...llm.guided import Guide, check_guided_ending
from ...mm.chat import template_tools
from ...mm.request import RequestBounds, RequestLimits
from .. import contract as c


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

    def fetch(self, url: str, kind: str) -> bytes:
        """A remote image's or video's file (`kind`), from an allowed host only
        (chat_messages.Fetch)."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https"):
            raise InputError(f"{kind} URL scheme {parsed.scheme or '(none)'!r} is not "
                             "supported; send a data URI or an https URL")
        host = (parsed.hostname or "").lower()
        if host not in self.allowed_hosts:
            raise InputError(f"remote {kind} URL on host {host!r} refused: this server fetches "
                             f"no remote {kind}s unless its host is on the image_url_allow_list "
                             f"parameter; send the {kind} as a data URI instead")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                data = response.read(self.max_bytes + 1)
        except OSError as exc:
            raise InputError(f"fetching {kind} {url} failed ({exc}); check the URL") from None
        if len(data) > self.max_bytes:
            raise InputError(f"{kind} at {url} exceeds {self.max_bytes} bytes; send a smaller "
                             "one")
        return data


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int | None  # None: the deployment's default
    min_tokens: int  # 0: off
    ignore_eos: bool
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int | None
    stop: tuple[str, ...]
    stream: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: CheckedMessages
    images: tuple[bytes, ...]  # in order of the image parts
    settings: GenerationSettings
    videos: tuple[VideoInput, ...] = ()  # in order of the video parts
    tools: list[dict[str, Any]] | None = None  # the functions the template lists
    cache_scope: str = ""  # contract.CACHE_SCOPE ("": the shared scope)


def chat_request(inputs: Mapping[str, Any], *, urls: UrlPolicy, defaults: SamplingDefaults,
                 limits: RequestLimits) -> ChatRequest:
    """`inputs`: public input name -> value (one batch row, scalars unwrapped; absent inputs
    missing; read by contract.EnsembleRequest); `defaults`: the checkpoint's
    (Checkpoint.generation.sampling_defaults()). The request's size and structure are checked
    (limits.bounds, the image and video counts) before any image or video is fetched or
    decoded. Raises InputError naming the input and the fix."""
    bounds = limits.bounds
    req = c.EnsembleRequest.from_row(inputs)
    # The guide goes to tensorrt_llm as sent: refused here where the stock backend would
    # refuse it, ignore it and answer unguided, or fail every request of a step with it
    # (llm/guided.py).
    guide = Guide.from_inputs(req.guided_decoding_guide_type, req.guided_decoding_guide)
    if guide is not None:
        check_guided_ending(not req.ignore_eos, req.min_tokens or 0)
        guide.check()
    bounds.check(f"the request's size in bytes ({', '.join(c.ENSEMBLE_BYTES_INPUTS)})",
                 req.payload_bytes(), "max_request_bytes",
                 "send smaller or fewer images and videos")
    tools = None if req.tools is None else template_tools(_parse_json(req.tools, c.TOOLS))
    if req.messages is not None:
        if req.text_input is not None or req.image_bytes or req.video_bytes or req.video_frames:
            raise InputError(f"send either {c.MESSAGES}, or {c.TEXT_INPUT} with "
                             f"{c.IMAGE_BYTES} and videos, not both")
        messages = limits.checked_messages(*_parse_messages(req.messages))
        images, videos = messages.images(urls.fetch), messages.videos(urls.fetch)
    elif req.text_input is not None:
        frame_lists = _frame_lists(req.video_frames, req.video_frame_counts)
        rates = _video_rates(req.video_fps, len(req.video_bytes) + len(frame_lists))
        messages = limits.checked_messages(user_message(
            req.text_input, len(req.image_bytes), len(req.video_bytes) + len(frame_lists)))
        images = tuple(_media_from_element(item, f"{c.IMAGE_BYTES}[{n}]", urls, "image")
                       for n, item in enumerate(req.image_bytes, 1))
        videos = tuple(
            [VideoFile(_media_from_element(item, f"{c.VIDEO_BYTES}[{n}]", urls, "video"), fps)
             for n, (item, fps) in enumerate(zip(req.video_bytes, rates, strict=False), 1)] +
            [VideoFrames(tuple(_media_from_element(f, f"{c.VIDEO_FRAMES}[{n}]", urls, "image")
                               for n, f in frames), fps)
             for frames, fps in zip(frame_lists, rates[len(req.video_bytes):], strict=True)])
    else:
        raise InputError(f"the request has neither {c.MESSAGES} nor {c.TEXT_INPUT}; send one "
                         "of them")
    if req.health_probe and (req.max_tokens != 1 or images or videos or guide is not None):
        # It goes ahead of the queue (runtime/admission.py): only for a probe's one token.
        raise InputError(f"a {c.HEALTH_PROBE} request is one generated token of a text-only "
                         f"request: send {c.MAX_TOKENS} = 1 and no image, video or guide")
    scope = req.cache_scope or ""
    if len(scope.encode()) > c.MAX_CACHE_SCOPE_BYTES:
        raise InputError(f"{c.CACHE_SCOPE} has {len(scope.encode())} bytes, above the "
                         f"{c.MAX_CACHE_SCOPE_BYTES} a scope may have; send a shorter name")
    return ChatRequest(messages, images, _settings(req, defaults, bounds), videos, tools,
                       scope)


def _parse_json(text: str, name: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{name} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}); send a JSON list of objects") from None
    except RecursionError:  # the parser's own bound, far above the one checked next
        raise c.too_deep(name) from None
    c.check_depth(value, name)
    return value


def _parse_messages(text: str) -> tuple[list[dict[str, Any]], Any]:
    """(the messages, the request's mm_processor_kwargs or None): a whole chat-completions
    body is accepted too, and of its other fields only that one is read here."""
    messages, kwargs = _parse_json(text, c.MESSAGES), None
    if isinstance(messages, Mapping) and "messages" in messages:
        messages, kwargs = messages["messages"], messages.get(MM_PROCESSOR_KWARGS)
    if not isinstance(messages, list) or not messages:
        raise InputError(MESSAGES_SHAPE)
    return messages, kwargs


def _frame_lists(frames: Sequence[bytes],
                 counts: Sequence[int] | None) -> list[list[tuple[int, bytes]]]:
    """video_frames split by video_frame_counts: each video's (element number, frame)."""
    numbered = list(enumerate(frames, 1))
    if counts is None:
        return [numbered] if numbered else []
    counts = list(counts)
    if any(c < 0 for c in counts) or sum(counts) != len(frames):
        raise InputError(f"video_frame_counts {counts} do not split the {len(frames)} "
                         "video_frames; send one count per video, adding up to the frames sent")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [numbered[a:a + c] for a, c in zip(starts, counts, strict=True)]


def _video_rates(values: Sequence[float], videos: int) -> list[float | None]:
    """video_fps: none, one for every video, or one per video."""
    rates = [check_fps(v, "video_fps") for v in values]
    if not rates:
        return [None] * videos
    if len(rates) == 1:
        return rates * videos
    if len(rates) != videos:
        raise InputError(f"video_fps holds {len(rates)} values for {videos} videos; send one "
                         "value, or one per video (files first, then frame lists)")
    return rates


def _media_from_element(data: bytes, name: str, urls: UrlPolicy, kind: str) -> bytes:
    """One BYTES element: the file itself, or its data URI or URL."""
    if data[:8].lower().startswith((b"data:", b"https://", b"http://")):
        return media_from_url(c.utf8(data, name), kind, urls.fetch)
    return data


def _settings(req: c.EnsembleRequest, defaults: SamplingDefaults,
              bounds: RequestBounds) -> GenerationSettings:
    def number(name: str, value: float | None, default: float, ok, what: str) -> float:
        if value is None:
            return default
        value = float(value)
        if not math.isfinite(value):  # an FP32 input beyond float32 arrives as inf
            raise InputError(f"{name} = {value} is not a finite number; send a number "
                             f"{what}")
        if not ok(value):
            raise InputError(f"{name} = {value} must be {what}")
        return value

    if req.max_tokens is not None:
        c.check_range(c.MAX_TOKENS, req.max_tokens, *c.SETTING_RANGES[c.MAX_TOKENS])
    min_tokens = 0 if req.min_tokens is None else req.min_tokens
    c.check_range(c.MIN_TOKENS, min_tokens, *c.SETTING_RANGES[c.MIN_TOKENS])
    if req.max_tokens is not None:  # else preprocessing checks it against the default taken
        c.check_min_tokens(min_tokens, req.max_tokens)
    bounds.check("the number of stop strings", len(req.stop), "max_stop_words",
                 "send fewer stop strings")
    for word in req.stop:
        if not word:
            raise InputError("stop holds an empty string; leave it out")
        bounds.check("the UTF-8 size of a stop string", len(word.encode()), "max_stop_bytes",
                     "send a shorter stop string")
    return GenerationSettings(
        max_tokens=req.max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(req.ignore_eos),
        temperature=number(c.TEMPERATURE, req.temperature, defaults.temperature,
                           lambda v: v >= 0, ">= 0"),
        top_p=number(c.TOP_P, req.top_p, defaults.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=int(number(c.TOP_K, req.top_k, defaults.top_k, lambda v: v >= 0,
                         ">= 0 (0 = off)")),
        seed=req.seed,
        stop=req.stop,
        stream=bool(req.stream),
    )
