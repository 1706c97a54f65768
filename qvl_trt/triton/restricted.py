"""Triton's APIs that change the server or read its internals, closed to every client but
serve and its gateway: the repository (index, load, unload), logging and trace settings. They
answer only requests that carry ADMIN_HEADER with the run's key (Triton's
--http-restricted-api and --grpc-restricted-protocol, triton-inference-server/server
docs/customization_guide/inference_protocols.md "Limit Endpoint Access"); health, metadata,
model configuration, statistics and inference stay open to the gateway and the probes."""

from __future__ import annotations

RESTRICTED_APIS = ("model-repository", "logging", "trace")
ADMIN_HEADER = "qvl-trt-admin"
# Where serve hands the key to the gateway it starts (the environment, not a command line).
ADMIN_KEY_ENV = "QVL_TRT_TRITON_ADMIN_KEY"


def http_headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {ADMIN_HEADER: key}


def grpc_headers(key: str | None) -> dict[str, str]:
    """gRPC metadata: Triton looks for the header under a prefix of its own
    (src/grpc/grpc_utils.h kRestrictedProtocolHeaderTemplate, "triton-grpc-protocol-")."""
    return {} if key is None else {f"triton-grpc-protocol-{ADMIN_HEADER}": key}
