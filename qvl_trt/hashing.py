"""Content hashes of what a build reads and writes: files (sha256, cached by size and mtime)
and JSON-able values (sha256 of their canonical JSON)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def fingerprint(value: Any) -> str:
    """sha256 of the canonical JSON of `value`."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass
class FileHasher:
    """sha256 of files, cached by (size, mtime) so re-hashing a large checkpoint that did
    not change costs a stat, not a read."""

    cache: dict[str, dict[str, Any]] = field(default_factory=dict)

    def hash(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self.cache.get(key)
        if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
            return hit["sha256"]
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        self.cache[key] = {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": digest.hexdigest(),
        }
        return digest.hexdigest()

    def hash_tree(self, root: Path) -> dict[str, str]:
        """Relative path -> sha256 for every file under `root`, bytecode caches left out:
        tritonserver's python stubs write `__pycache__` beside a served repository's model.py
        (their embedded interpreter ignores PYTHONDONTWRITEBYTECODE), which must not make
        the next build rerun the stage that wrote the repository."""
        return {
            str(p.relative_to(root)): self.hash(p) for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.relative_to(root).parts
        }
