"""The vision encoder's cache of prompt-table rows, keyed by image content.

A follow-up question about the same image (a chat turn, a retry, several users sending one
picture) skips the vision tower. The cache holds each image's rows (main + DeepStack rows
of every visual token) and is bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int


class RowCache:
    """LRU map image key -> rows (a numpy array), at most `capacity_bytes` in total. An entry
    larger than the whole capacity is not kept. Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            rows = self._entries.get(key)
            if rows is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return rows

    def put(self, key: tuple, rows: np.ndarray) -> None:
        """Keep `rows` itself, not a copy (a prompt table is tens of MB): the caller hands
        over an array nobody writes any more, and it becomes read-only."""
        if rows.nbytes > self.capacity_bytes:
            return
        rows.setflags(write=False)  # callers share cached arrays
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = rows
            self._bytes += rows.nbytes
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._bytes)
