"""The vision encoder's row cache (qvl_trt/vision/cache.py)."""

from __future__ import annotations

import numpy as np
import pytest

from qvl_trt.vision.cache import RowCache


def test_row_cache_is_bounded_in_bytes_and_least_recently_used_goes_first() -> None:
    rows = np.zeros((4, 8), np.float16)  # 64 bytes
    cache = RowCache(capacity_bytes=150)
    cache.put(("a",), rows)
    cache.put(("b",), rows)
    assert cache.get(("a",)) is not None  # a is now the most recent
    cache.put(("c",), rows)  # 192 bytes > 150: b goes
    assert cache.get(("b",)) is None and cache.get(("c",)) is not None
    cache.put(("huge",), np.zeros((100, 8), np.float16))  # larger than the cache: not kept
    assert cache.get(("huge",)) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (2, 2, 2, 128)
    with pytest.raises(ValueError):
        cache.get(("a",))[0, 0] = 1  # cached rows are shared read-only
