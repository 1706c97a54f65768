"""A least-recently-used map bounded in bytes, for the caches that clients fill (image rows,
compiled guides): every cache a request can grow has a byte bound, so memory comes back."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int


class BytesLru(Generic[K, V]):
    """LRU map key -> value, at most `capacity_bytes` in total by `size(key, value)`. An entry
    larger than the whole capacity is not kept. Thread-safe."""

    def __init__(self, capacity_bytes: int, size: Callable[[K, V], int]) -> None:
        self.capacity_bytes = capacity_bytes
        self._size = size
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: K, value: V) -> None:
        size = self._size(key, value)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._bytes)
