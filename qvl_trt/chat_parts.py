"""The content parts of a chat message (OpenAI's, vLLM's and qwen-vl-utils' types) that carry
an image or a video: what the chat template renders as one (mm/chat.py), what preprocessing
counts against a build's limits (mm/request.py) and what the gateway counts to pick a build
(gateway/routing.py), which must not load mm/."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")


def media_counts(messages: Sequence[Any]) -> tuple[int, int]:
    """(image parts, video parts) of chat messages as sent; what is not a message or a part
    counts as neither (preprocessing refuses it)."""
    images = videos = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            images += kind in IMAGE_PART_TYPES
            videos += kind in VIDEO_PART_TYPES
    return images, videos
