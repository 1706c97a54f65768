"""Chat messages -> prompt token ids through the checkpoint's tokenizer and chat template.

Messages are OpenAI-style: `{"role": ..., "content": str | [part, ...]}` with parts
`{"type": "text", "text": ...}`, `{"type": "image"}` / `{"type": "image_url", ...}` and
`{"type": "video"}` / `{"type": "video_url", ...}`; the images and videos themselves travel
separately, in order of appearance. The template writes
`<|vision_start|><|image_pad|><|vision_end|>` per image; each pad becomes as many pad tokens
as the image has merged patches, as the HF processor does (it expands the text before
tokenising; special tokens split the text, so expanding the ids after is the same). A video's
`<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal group, `<t.t seconds>
<|vision_start|><|video_pad|><|vision_end|>`, and each group's pad then as many pads as the
group has merged patches. The template's own vision_start/vision_end around the video go: the
groups carry their own. That is the layout of the released model's processor (transformers
4.57 `Qwen3VLProcessor.__call__` replaces the whole wrapper) and of transformers <= 5.9 and
>= 5.25; 5.10 to 5.24 kept the outer pair (their `replace_video_token` replaced the pad
alone), a regression that 5.25's `get_text_with_replacements` undoes. A bare pad (no wrapper
around it) expands the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..chat_parts import IMAGE_PART_TYPES, VIDEO_PART_TYPES
from ..checkpoint import TokenIds
from ..deps import require
from ..errors import CheckpointError, EngineLimitError, InputError

ROLES = ("system", "user", "assistant", "tool")


def user_message(prompt: str, image_count: int, video_count: int = 0) -> list[dict[str, Any]]:
    """One user turn: the images, the videos, then the text (Qwen's own examples' order)."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(image_count)]
    parts += [{"type": "video"} for _ in range(video_count)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


class PromptBuilder:
    """The checkpoint's tokenizer and chat template, loaded once."""

    def __init__(self, tokenizer: Any, token_ids: TokenIds) -> None:
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.max_token_bytes = _max_token_bytes(tokenizer)

    @classmethod
    def from_checkpoint(cls, path: Path, token_ids: TokenIds) -> PromptBuilder:
        transformers = require("transformers", extra="serve", why="tokenize prompts")
        try:
            # tokenizer.json as shipped; AutoTokenizer would import torch (via its config
            # classes), which the preprocessing model does without.
            tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot load the tokenizer ({exc}); the checkpoint "
                                  "needs tokenizer.json and tokenizer_config.json") from None
        # transformers 5 reads the processor's chat_template.json/.jinja into the tokenizer;
        # 4.x only tokenizer_config.json's.
        tokenizer.chat_template = tokenizer.chat_template or _template_file(Path(path))
        if not tokenizer.chat_template:
            raise CheckpointError(f"{path} has no chat template (chat_template.jinja, "
                                  "chat_template.json or tokenizer_config.json); re-download "
                                  "the checkpoint")
        return cls(tokenizer, token_ids)

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, int, int]:
        """The prompt text with the generation prompt appended, its image and video counts;
        `tools` (OpenAI's function tools) are listed by the template for the model to call."""
        clean, images, videos = _template_messages(messages)
        text = self.tokenizer.apply_chat_template(
            clean, tools=template_tools(tools) if tools else None, tokenize=False,
            add_generation_prompt=True)
        return text, images, videos

    def check_fits(self, text: str, max_tokens: int) -> None:
        """Refuse rendered text that cannot tokenize to `max_tokens` or fewer, from its size
        alone (before tokenizing it): no token covers more than `max_token_bytes` of the
        normalized text, so text above max_tokens x that many bytes has more tokens. The bound
        never refuses text that fits: a run of spaces of that size is exactly max_tokens
        tokens of the longest one."""
        if self.max_token_bytes is None:
            return
        normalizer = self.tokenizer.backend_tokenizer.normalizer
        size = len((normalizer.normalize_str(text) if normalizer else text).encode())
        most = max_tokens * self.max_token_bytes
        if size > most:
            raise EngineLimitError(
                f"prompt of {size} bytes cannot fit in the engine's {max_tokens} tokens (a "
                f"token covers at most {self.max_token_bytes} bytes, so {most} bytes at "
                "most); shorten the text")

    def placeholders(self, text: str, images: int, videos: int) -> list[bool]:
        """For each image or video placeholder of rendered text, in order: is it a video's?
        Refuses counts other than `images` and `videos` (a pad typed into a message's text)."""
        image_pad, video_pad = self.tokenizer.convert_ids_to_tokens(
            [self.token_ids.image, self.token_ids.video])
        found = [m.group() == video_pad for m in
                 re.finditer(f"{re.escape(image_pad)}|{re.escape(video_pad)}", text)]
        for kind, pad, sent, held in (("image", image_pad, images, found.count(False)),
                                      ("video", video_pad, videos, found.count(True))):
            if held != sent:
                raise InputError(
                    f"the prompt holds {held} {kind} placeholders for {sent} {kind}s; put each "
                    f"{kind} as an {kind} part of a user message and keep {pad} out of the text")
        return found

    def tokenize(self, text: str, image_token_counts: Sequence[int],
                 videos: Sequence[Sequence[tuple[str, int]]] = ()) -> np.ndarray:
        """Tokenise rendered text: image pad i becomes image_token_counts[i] pads; video pad v
        (with the template's vision_start/vision_end around it) becomes, per temporal group of
        videos[v] = [(timestamp text, merged tokens), ...], the timestamp and the group's pads
        between vision_start and vision_end."""
        ids = self.encode(text, len(image_token_counts),
                          [[stamp for stamp, _ in groups] for groups in videos])
        return self.expand(ids, image_token_counts,
                           [[tokens for _, tokens in groups] for groups in videos])

    def encode(self, text: str, images: int,
               video_stamps: Sequence[Sequence[str]] = ()) -> np.ndarray:
        """`tokenize`'s first half, which needs no image sizes (a request runs it while its
        images decode): ids with one pad per image and per temporal group of each video,
        video_stamps[v] holding each group's timestamp text."""
        self.placeholders(text, images, len(video_stamps))
        if video_stamps:
            start, end, video_pad = self.tokenizer.convert_ids_to_tokens(
                [self.token_ids.vision_start, self.token_ids.vision_end, self.token_ids.video])
            pieces = text.replace(f"{start}{video_pad}{end}", video_pad).split(video_pad)
            text = pieces[0] + "".join(
                "".join(f"{stamp}{start}{video_pad}{end}" for stamp in stamps) + piece
                for stamps, piece in zip(video_stamps, pieces[1:], strict=True))
        return np.asarray(self.tokenizer(text)["input_ids"], dtype=np.int32)

    def expand(self, ids: np.ndarray, image_token_counts: Sequence[int],
               video_token_counts: Sequence[Sequence[int]] = ()) -> np.ndarray:
        """`tokenize`'s second half: each pad of `encode`'s ids repeated to its merged token
        count (video_token_counts[v]: one count per temporal group)."""
        repeats = np.ones(ids.size, np.int64)
        repeats[ids == self.token_ids.image] = image_token_counts
        repeats[ids == self.token_ids.video] = [tokens for groups in video_token_counts
                                                for tokens in groups]
        return np.repeat(ids, repeats)


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse malformed messages (roles, parts, images or videos outside user turns) before
    any of their images or videos is fetched or decoded."""
    _template_messages(messages)


def template_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's function tools reduced to what Qwen's template lists (`tool | tojson`, in the
    shape Qwen was trained on: type, function name, description, parameters), validated."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InputError("tools must be a JSON list of {type: function, function: {name, "
                         "description, parameters}} objects")
    clean = []
    for n, tool in enumerate(tools, 1):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or \
                not isinstance(function, Mapping):
            raise InputError(f"tool {n} is not {{type: function, function: {{name, ...}}}}; "
                             "only function tools are supported")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise InputError(f"tool {n} has no function name; give each function a name")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InputError(f"tool {n} ({name}): parameters must be a JSON schema object")
        kept = {key: function[key] for key in ("name", "description", "parameters")
                if function.get(key) is not None}
        clean.append({"type": "function", "function": kept})
    return clean


def _max_token_bytes(tokenizer: Any) -> int | None:
    """Bytes of text one token covers at most: the longest token of a byte-level BPE without
    an unknown token (each character of its vocabulary stands for one byte) or the longest
    added token; None for other tokenizers (an unknown token covers any text)."""
    tokenizers = require("tokenizers", extra="serve", why="tokenize prompts")
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.model, tokenizers.models.BPE) or backend.model.unk_token or \
            not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        return None
    added = [token.content for token in tokenizer.added_tokens_decoder.values()]
    return max([len(t) for t in backend.get_vocab(with_added_tokens=False)] +
               [len(t.encode()) for t in added])


def _template_file(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        return json.loads((path / "chat_template.json").read_text(encoding="utf-8"))[
            "chat_template"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _template_messages(messages: Sequence[Mapping[str, Any]]) \
        -> tuple[list[dict[str, Any]], int, int]:
    """Messages reduced to what the template reads (image and video data stay out of it),
    validated; with the counts of images and videos."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of {role, content} objects")
    clean, images, videos = [], 0, 0
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
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                if role != "user":
                    raise InputError(f"message {n}: images go in user messages, not {role}")
                parts.append({"type": "image"})
                images += 1
            elif kind in VIDEO_PART_TYPES:
                if role != "user":
                    raise InputError(f"message {n}: videos go in user messages, not {role}; "
                                     "move the video to a user turn")
                parts.append({"type": "video"})
                videos += 1
            else:
                raise InputError(f"message {n}: content part {repr(part)[:60]} is neither "
                                 "{type: text, text: ...}, {type: image} nor {type: video}")
        clean.append({"role": role, "content": parts, **calls})
    return clean, images, videos


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
