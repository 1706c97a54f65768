"""A least-recently-used map bounded in bytes (and optionally in entries), for the caches that
clients fill (image rows, compiled guides, answers): every cache a request can grow has a byte
bound, so memory comes back."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Why an entry was pushed out, as `on_evict` is told: the entry bound, the byte bound.
EVICTED_FOR_ENTRIES = "capacity"
EVICTED_FOR_BYTES = "bytes"


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int


class BytesLru(Generic[K, V]):
    """LRU map key -> value, at most `capacity_bytes` in total by `size(key, value)` and at
    most `max_entries` entries (None: no bound). An entry larger than the whole capacity is
    not kept. `on_evict(reason)` is called for each entry the bounds push out. Thread-safe."""

    def __init__(self, capacity_bytes: int, size: Callable[[K, V], int], *,
                 max_entries: int | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self._size = size
        self._on_evict = on_evict
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

    def pop(self, key: K) -> V | None:
        """Remove the entry of `key` (no eviction: the caller says why); its value or None."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Keep `value`; False where it is larger than the whole capacity (not kept)."""
        size = self._size(key, value)
        if size > self.capacity_bytes:
            return False
        evicted = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes or (
                    self.max_entries is not None and len(self._entries) > self.max_entries):
                reason = EVICTED_FOR_BYTES if self._bytes > self.capacity_bytes \
                    else EVICTED_FOR_ENTRIES
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                evicted.append(reason)
        if self._on_evict is not None:  # outside the lock: the callback may read stats()
            for reason in evicted:
                self._on_evict(reason)
        return True

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._bytes)
