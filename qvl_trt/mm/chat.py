"""Chat messages -> prompt token ids through the checkpoint's tokenizer and chat template.

The messages come checked and reduced to what the template reads (chat_messages.py
read_messages); the images and videos themselves travel separately, in order of appearance.
The template writes `<|vision_start|><|image_pad|><|vision_end|>` per image; each pad becomes
as many pad tokens as the image has merged patches, as the HF processor does (it expands the
text before tokenising; special tokens split the text, so expanding the ids after is the
same). A video's
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

from ..chat_messages import CheckedMessages, read_messages
from ..checkpoint import TokenIds
from ..deps import require
from ..errors import CheckpointError, EngineLimitError, InputError


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

    def render(self, messages: CheckedMessages | Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, int, int]:
        """The prompt text with the generation prompt appended, its image and video counts;
        `tools` (OpenAI's function tools) are listed by the template for the model to call.
        Messages not yet checked are checked here."""
        checked = messages if isinstance(messages, CheckedMessages) else read_messages(messages)
        text = self.tokenizer.apply_chat_template(
            checked.template, tools=template_tools(tools) if tools else None, tokenize=False,
            add_generation_prompt=True)
        return text, len(checked.image_parts), len(checked.video_parts)

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
