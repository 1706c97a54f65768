"""The gateway's options (`qvl-trt gateway`, `qvl-trt serve --openai-port`): standard library
only, so the CLI reads its defaults here without loading the server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

DEFAULT_PORT = 9000
# Where `qvl-trt gateway` and `qvl-trt serve --openai-port` read the API key (an environment
# variable, not an argument: a command line is visible to every user of the machine).
API_KEY_ENV = "QVL_TRT_API_KEY"


@dataclass(frozen=True)
class AnswerCacheOptions:
    """The answer cache (answer_cache.py): deterministic answers kept for repeated requests."""

    enabled: bool = True
    max_entries: int = 4096
    max_mib: float = 64.0  # the answers' text and pieces, as answer_cache.py counts them
    ttl_s: float = 600.0  # an answer older than this is asked again
    # Requests with `tools`: off by default, as a tool call's answer is often acted on (the
    # call made) and a client may want a fresh decision each time; on: cached like the rest.
    tools: bool = False

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ConfigError(f"--answer-cache-entries {self.max_entries} must be at least 1; "
                              "turn the cache off with --no-answer-cache")
        if not self.max_mib > 0:
            raise ConfigError(f"--answer-cache-mib {self.max_mib:g} must be above 0; turn the "
                              "cache off with --no-answer-cache")
        if not self.ttl_s > 0:
            raise ConfigError(f"--answer-cache-ttl {self.ttl_s:g} must be above 0 seconds; "
                              "turn the cache off with --no-answer-cache")

    @property
    def max_bytes(self) -> int:
        return int(self.max_mib * 2**20)


@dataclass(frozen=True)
class GatewayOptions:
    triton_url: str  # HOST:PORT of Triton's gRPC endpoint (client.generate.parse_url)
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    # Chat requests sent on to Triton at once, and up to max_queue more waiting in the gateway
    # for one, shared fairly by tenants; more get 429. None: from the builds (Gateway.slot_limits).
    max_concurrency: int | None = None
    max_queue: int | None = None
    max_body_bytes: int | None = None  # None: from the deployment (see the module doc)
    shutdown_timeout_s: float = 10.0
    api_key: str | None = field(default=None, repr=False)  # None: no key asked
    keys_file: Path | None = None  # tenants' keys (tenants.py), instead of api_key
    # The key of Triton's restricted APIs (triton/restricted.py), which its discovery of the
    # builds asks (the repository index); None: a Triton that restricts nothing.
    triton_admin_key: str | None = field(default=None, repr=False)
    # serve's /ready, which this gateway's /ready then forwards (readiness.py); None: ask Triton
    ready_url: str | None = None
    answer_cache: AnswerCacheOptions = AnswerCacheOptions()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port; use 1-65535")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency {self.max_concurrency} must be at least 1")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError(f"--max-queue {self.max_queue} must be >= 0")
        if self.keys_file is not None and self.api_key is not None:
            raise ConfigError(f"both ${API_KEY_ENV} and --keys-file are set; give the one key "
                              "a tenant in the keys file (`qvl-trt keys add`) and unset "
                              f"${API_KEY_ENV}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes {self.max_body_bytes} is below 1024; a chat "
                              "request does not fit")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"--shutdown-timeout {self.shutdown_timeout_s} must be >= 0")
        key = self.api_key
        if key is not None and (not key or not key.isprintable()
                                or any(ch.isspace() for ch in key)):
            raise ConfigError(f"the API key (${API_KEY_ENV}) is empty or has spaces or control "
                              "characters; use a printable token without spaces")


def triton_grpc_address(url: str) -> str:
    """HOST:PORT of `--url grpc://HOST:PORT`: the gateway talks to Triton over gRPC only."""
    from ..client.generate import parse_url

    endpoint = parse_url(url)
    if endpoint.protocol != "grpc":
        raise ConfigError(f"--url {url}: the gateway talks to Triton over gRPC; pass "
                          "grpc://HOST:PORT (Triton's --grpc-port, 8001 by default)")
    return endpoint.address
