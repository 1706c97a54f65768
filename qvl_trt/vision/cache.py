"""The vision encoder's cache of prompt-table rows, keyed by image content.

A follow-up question about the same image (a chat turn, a retry, several users sending one
picture) skips the vision tower. The cache holds each image's rows (main + DeepStack rows
of every visual token) and is bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import numpy as np

from ..lru import BytesLru, CacheStats

__all__ = ["CacheStats", "RowCache"]


class RowCache(BytesLru[tuple, np.ndarray]):
    """LRU map image key -> rows (a numpy array), at most `capacity_bytes` in total. An entry
    larger than the whole capacity is not kept. Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, lambda key, rows: rows.nbytes)

    def put(self, key: tuple, rows: np.ndarray) -> None:
        """Keep `rows` itself, not a copy (a prompt table is tens of MB): the caller hands
        over an array nobody writes any more, and it becomes read-only."""
        if rows.nbytes <= self.capacity_bytes:
            rows.setflags(write=False)  # callers share cached arrays
        super().put(key, rows)
