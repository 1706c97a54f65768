"""Writing files and folders so that nobody ever sees them half-written: fill a temporary
sibling, rename it into place when complete, remove it on failure."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

PARTIAL = ".partial-"  # staging names: .<name>.partial-XXXX
OLD = ".old-"  # a replaced folder, deleted right after: .<name>.old-PID


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield an empty folder beside `out` to fill. When the block succeeds it becomes `out`
    (an existing `out` is swapped out only then); when it fails it is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}{PARTIAL}"))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp's 0700 would surprise users sharing the folder
        replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder `src` to `dst`, replacing an older `dst`."""
    old = dst.with_name(f".{dst.name}{OLD}{os.getpid()}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def leftovers(folder: Path) -> list[Path]:
    """Staging and replaced folders that an interrupted writer left in `folder`."""
    return [*folder.glob(f".*{PARTIAL}*"), *folder.glob(f".*{OLD}*")]


@contextmanager
def staged_file(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Yield an open temporary sibling of `path`; it becomes `path` when the block succeeds
    and is removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{PARTIAL}")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; others (Triton, CI caches) read these
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any, *, indent: int | None = 2) -> None:
    """Write `data` as JSON (indented unless `indent` is None) through `staged_file`."""
    with staged_file(path, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")
