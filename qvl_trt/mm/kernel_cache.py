"""Where the compiled pixel kernels (kernels.py) are kept between processes, so that numba
compiles them once per machine rather than in every preprocessing instance at every start
(about 3 s each, also after a crashed stub's restart).

numba's own `cache=True` keys its cache by source-file path (numba/core/caching.py locators;
a zipped module, where a numba version has a locator for it at all, always goes to the user
folder): the python models import qvl_trt from a zip inside each repository, so every
repository (and every copy of one) would compile again. Here the cache lives
in one folder per kernels source and numba version, `<root>/qvl_trt_kernels/<numba>-<sha256 of
kernels.py>`: a changed kernels.py uses a new folder (no stale code is ever loaded), and numba
still checks its version and the CPU of each entry. The root is `NUMBA_CACHE_DIR` where set,
else numba's user-wide cache folder (`~/.cache/numba`). Where it cannot be written, the
kernels compile in memory as without a cache.

Processes share it safely: numba writes each file to a temporary name and renames it into
place; saves hold an exclusive lock on the folder, so two processes never number two
signatures' data files alike (numba picks the next free number from the index it read).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numba
from numba.core import caching
from numba.core.dispatcher import Dispatcher

log = logging.getLogger(__name__)

FOLDER = "qvl_trt_kernels"
_LOCK = ".lock"


def cache_root() -> Path:
    """`NUMBA_CACHE_DIR` (numba reads it when imported), else numba's user-wide folder."""
    if numba.config.CACHE_DIR:
        return Path(numba.config.CACHE_DIR)
    from numba.misc.appdirs import AppDirs

    return Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)


def cache_dir(source: bytes) -> Path:
    """The folder of the kernels compiled from `source` (kernels.py's bytes)."""
    digest = hashlib.sha256(source).hexdigest()[:16]
    return cache_root() / FOLDER / f"{numba.__version__}-{digest}"


def enable(source: bytes, *kernels: Dispatcher) -> Path | None:
    """Load and save `kernels` (numba.njit functions of one module whose bytes are `source`)
    in `cache_dir(source)`; None (and they compile in memory) where it cannot be written."""
    folder = cache_dir(source)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        log.warning("the pixel kernels compile in every process: cannot write their cache "
                    "%s (%s); set NUMBA_CACHE_DIR to a writable folder", folder, exc)
        return None
    for kernel in kernels:
        # What Dispatcher.enable_caching does (numba/core/dispatcher.py), with our locator.
        kernel._cache = _KernelCache(kernel.py_func, folder)
    return folder


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    with open(os.path.join(folder, _LOCK), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


class _Locator(caching._CacheLocator):
    """One fixed folder (`folder`, set per cache); its name already says which source it
    holds, so it is the source stamp too."""

    folder = ""

    def __init__(self, py_func) -> None:
        self._lineno = py_func.__code__.co_firstlineno

    def get_cache_path(self) -> str:
        return self.folder

    def get_source_stamp(self) -> str:
        return os.path.basename(self.folder)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func)


class _KernelCache(caching.FunctionCache):
    """numba's per-function cache (index and data files) in `folder`, saving under its lock."""

    def __init__(self, py_func, folder: Path) -> None:
        locator = type("_FolderLocator", (_Locator,), {"folder": str(folder)})
        # numba's CacheImpl takes the first of its `_locator_classes` that accepts the function
        self._impl_class = type("_FolderCacheImpl", (caching.CompileResultCacheImpl,),
                                {"_locator_classes": [locator]})
        super().__init__(py_func)

    def save_overload(self, sig, data) -> None:
        try:
            with _locked(self._cache_path):
                super().save_overload(sig, data)
        except OSError as exc:  # the compiled code stays in memory; the next process compiles
            log.warning("could not save a compiled pixel kernel in %s: %s", self._cache_path,
                        exc)
