"""The host's thread pool for pixel work (image strips, video frames): numpy, Pillow and the
compiled kernels (kernels.py) release the GIL in their loops, so threads use every core of a
preprocessing instance."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[int, ThreadPoolExecutor] = {}


def pixel_pool() -> ThreadPoolExecutor:
    """One pool per process (a forked child inherits the object, not its threads)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                         thread_name_prefix="qvl-pixels")
    return _POOLS[pid]
