"""Where the data folders that ship beside the package live: `build_configs/` (GPU profiles)
and `triton_repo/` (model templates). In a source checkout they sit next to `qvl_trt/`; an
installed wheel puts them under `<prefix>/share/qvl-trt/`."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import QvlError

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The shipped folder `name` (e.g. "build_configs")."""
    for root in (_SOURCE_ROOT, Path(sys.prefix) / "share" / "qvl-trt"):
        candidate = root / name
        if candidate.is_dir():
            return candidate
    raise QvlError(
        f"the data folder {name}/ was not found beside qvl_trt or under "
        f"{sys.prefix}/share/qvl-trt; reinstall qvl-trt"
    )
