"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once; a rank file of
an unsplit 8B model is 16 GB. Here the header is written first from the declared names,
dtypes and shapes, then each tensor's bytes are appended as it is produced, so memory holds
one tensor, not the file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

from ..deps import require
from ..dtypes import Dtype


class SafetensorsStream:
    """A safetensors file whose tensors, all in `dtype`, are written in the declared order."""

    def __init__(self, path: Path, dtype: Dtype | str,
                 shapes: dict[str, tuple[int, ...]]) -> None:
        dtype = Dtype(dtype)
        self.path = path
        self._order = list(shapes)
        self._sizes = {name: math.prod(shape) * dtype.itemsize
                       for name, shape in shapes.items()}
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shapes.items():
            header[name] = {"dtype": dtype.safetensors, "shape": list(shape),
                            "data_offsets": [offset, offset + self._sizes[name]]}
            offset += self._sizes[name]
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self._file: BinaryIO = path.open("wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor) -> None:
        """Append `tensor` (torch, the declared dtype and shape) as the next tensor."""
        expected = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"{self.path.name}: wrote {name} where {expected} is next")
        torch = require("torch", extra="export", why="write checkpoint weights")
        raw = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy()
        if raw.nbytes != self._sizes[name]:
            raise RuntimeError(f"{self.path.name}: {name} has {raw.nbytes} bytes, "
                               f"declared {self._sizes[name]}")
        self._file.write(raw.data)
        self._next += 1

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        if exc_type is None and self._next != len(self._order):
            raise RuntimeError(f"{self.path.name}: {len(self._order) - self._next} declared "
                               "tensors were never written")
