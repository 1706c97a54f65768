"""The `qvl-trt` command line (app.py), its commands by help panel, and its renderers
(console.py)."""

from . import build, diagnostics, serve  # noqa: F401  (registers the commands, in panel order)
from .app import app, main

__all__ = ["app", "main"]
