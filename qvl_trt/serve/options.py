"""`qvl-trt serve`'s options, read by the CLI for its defaults without loading the server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..gateway.options import AnswerCacheOptions
from .liveness import LivenessRules
from .server import Ports, ServerOptions


@dataclass(frozen=True)
class ServeOptions:
    """`qvl-trt serve`'s options; the CLI's defaults are these."""

    ports: Ports = Ports()
    pick_free_ports: bool = False  # instead of `ports`
    host: str = "0.0.0.0"
    # Triton's HTTP and gRPC endpoints (None: `host`); the metrics and health ones stay on
    # `host`.
    inference_host: str | None = None
    world_size: int | None = None  # None: the engines'
    log_file: Path | None = None
    log_verbose: int = 0
    health_port: int | None = None  # GET /ready and /live on this port; None: none
    openai_port: int | None = None  # the gateway on this port; None: no gateway
    openai_host: str | None = None  # None: `host`
    api_key: str | None = field(default=None, repr=False)  # the gateway asks for it
    keys_file: Path | None = None  # the gateway's tenants and keys, instead of api_key
    # After SIGTERM, how long the requests in flight get to finish before they are cut.
    drain_timeout_s: float = ServerOptions.drain_timeout_s
    liveness: LivenessRules = LivenessRules()  # when a busy server counts as dead
    answer_cache: bool = AnswerCacheOptions.enabled  # the gateway's, at its default bounds
    warm_up: bool = True  # a warm request through each ensemble before ready (serve/warmup.py)
