"""Where tritonserver listens and what it answers unasked, with a real tritonserver on an
empty repository: every endpoint on IPv6 (an IPv6 single-stack cluster's pods), the HTTP and
gRPC ones apart from the metrics one (a pod keeps them on the loopback interface), and the
repository, logging and trace APIs closed to a client without the run's key."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from qvl_trt.machine import find_tritonserver
from qvl_trt.serve.server import (
    ServerOptions,
    TritonServer,
    format_command,
    free_ports,
    host_port,
    new_admin_key,
    server_command,
    triton_address,
)
from qvl_trt.serve.supervisor import HealthServer
from qvl_trt.triton.restricted import grpc_headers

pytestmark = pytest.mark.skipif(find_tritonserver() is None,
                                reason="needs a tritonserver: pip install 'qvl-trt[serve]'")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Metrics on every IPv6 address, HTTP and gRPC on the IPv6 loopback one only."""
    repo = tmp_path_factory.mktemp("empty-repo")
    opts = ServerOptions(repo, free_ports("::1"), host="::", inference_host="::1",
                         explicit_models=(), admin_key=new_admin_key())
    with TritonServer(opts, log_file=repo.parent / "server.log") as running:
        yield running


def status(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None,
                                     method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def reachable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def test_tritonserver_takes_ipv6_addresses_in_its_own_forms() -> None:
    assert [triton_address("::", e) for e in ("http", "grpc", "metrics")] == \
        ["ipv6:::", "[::]", "ipv6:::"]
    assert triton_address("0.0.0.0", "grpc") == "0.0.0.0"
    assert host_port("::1", 8000) == "[::1]:8000" and host_port("10.0.0.1", 80) == "10.0.0.1:80"


def test_every_endpoint_answers_on_ipv6_and_inference_only_where_asked(server) -> None:
    ports = server.opts.ports
    assert server.http_url == f"[::1]:{ports.http}"
    assert status(f"http://{server.http_url}/v2/health/ready")[0] == 200
    assert status(server.metrics_url)[0] == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_live()
    # HTTP and gRPC listen where --inference-host says, not where metrics do.
    assert reachable("127.0.0.1", ports.metrics) is False  # Triton's IPv6 sockets are v6-only
    assert reachable("::1", ports.http) and not reachable("127.0.0.1", ports.http)


def test_the_repository_logging_and_trace_apis_ask_for_the_runs_key(server) -> None:
    base = f"http://{server.http_url}/v2"
    for method, path in (("POST", "/repository/index"), ("GET", "/logging"),
                         ("GET", "/trace/setting"), ("POST", "/repository/models/x/load")):
        code, body = status(base + path, method)
        assert (code, "restricted" in body) == (403, True), (path, code, body)
    assert status(f"{base}/repository/index", "POST", server.admin_headers) == (200, "[]")
    assert status(f"{base}/logging", "GET", {"qvl-trt-admin": "not-the-key"})[0] == 403
    # What stays open: health, server metadata, statistics.
    assert status(base)[0] == status(f"{base}/models/stats")[0] == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="restricted"):
        client.get_model_repository_index()
    assert client.get_model_repository_index(
        headers=grpc_headers(server.opts.admin_key)) is not None
    # The key is a secret of the run: never in a log line or a printed command.
    shown = format_command(server_command(server.install, server.opts), server.install)
    assert server.opts.admin_key not in shown and "qvl-trt-admin=KEY" in shown
    assert server.opts.admin_key not in repr(server.opts)


def test_the_health_endpoint_on_ipv6_answers_both_families() -> None:
    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    health = HealthServer(("::", 0), Ok)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    try:
        port = health.server_address[1]
        assert status(f"http://[::1]:{port}/ready")[0] == 200
        assert status(f"http://127.0.0.1:{port}/ready")[0] == 200
    finally:
        health.shutdown()
        health.server_close()
