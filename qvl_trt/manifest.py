"""The build manifest (`manifest.json` in a build folder): what each stage was built from and
what it wrote, so an unchanged stage is skipped and a build can be resumed elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BuildError

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1


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
        """Relative path -> sha256 for every file under `root`."""
        return {
            str(p.relative_to(root)): self.hash(p) for p in sorted(root.rglob("*")) if p.is_file()
        }


@dataclass
class Manifest:
    """Read and written as JSON; `stages` maps a stage name to its record."""

    options: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    file_hashes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, build_dir: Path) -> Manifest | None:
        path = build_dir / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BuildError(
                f"{path} is corrupt ({exc}); delete {build_dir} and build again"
            ) from None
        if data.get("schema_version") != SCHEMA_VERSION:
            raise BuildError(
                f"{path} was written by another qvl-trt version (schema "
                f"{data.get('schema_version')}); build into a new folder"
            )
        return cls(
            options=data.get("options", {}),
            stages=data.get("stages", {}),
            tools=data.get("tools", {}),
            file_hashes=data.get("file_hashes", {}),
        )

    def save(self, build_dir: Path) -> None:
        data = {
            "schema_version": SCHEMA_VERSION,
            "options": self.options,
            "tools": self.tools,
            "stages": self.stages,
            "file_hashes": self.file_hashes,
        }
        write_json_atomic(build_dir / MANIFEST_NAME, data)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
