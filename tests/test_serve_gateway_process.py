"""The gateway as a process: it never outlives the process that started it (kill -9 included),
SIGTERM lets the answers in flight finish, refuses new connections and exits 0, and bad
options are one-line errors."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from cli_harness import run_cli

from qvl_trt.testing.processes import group_alive, group_gone_within
from qvl_trt.triton import contract as c

openai = pytest.importorskip("openai", reason="the tests use the openai package as the client: "
                             "pip install openai")
pytest.importorskip("aiohttp", reason="the gateway needs aiohttp: pip install 'qvl-trt[gateway]'")

PARENT = """
import sys, time
from qvl_trt.gateway.options import GatewayOptions
from qvl_trt.serve.gateway_process import GatewayProcess

gateway = GatewayProcess(GatewayOptions(sys.argv[1], port=int(sys.argv[2]))).start()
print("PID", gateway.process.pid, flush=True)
time.sleep(600)
"""


def test_the_gateway_dies_with_the_process_that_started_it() -> None:
    from qvl_trt.serve.server import free_ports

    ports = free_ports()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"127.0.0.1:{ports.grpc}",
                               str(ports.http)], stdout=subprocess.PIPE, text=True)
    try:
        pid = next(int(line.split()[1]) for line in parent.stdout if line.startswith("PID "))
        assert group_alive(pid)
    finally:
        parent.kill()
        parent.wait()
    assert group_gone_within(pid), "the gateway outlived its parent"


def test_sigterm_finishes_the_answer_in_flight_then_exits_0(triton_server, tmp_path) -> None:
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    port = free_ports().http
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(GatewayOptions(triton_server.grpc_url, port=port), log_file=log)
    gateway.start()
    gateway.wait_ready()
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    process = gateway.process
    stopped: list[int | None] = []
    try:
        stream = api.chat.completions.create(
            model=c.ENSEMBLE, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=60, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        stopper = threading.Thread(target=lambda: stopped.append(gateway.stop()))
        stopper.start()
        deadline = time.monotonic() + 10
        while True:  # the listening socket closes at once
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        rest = list(chunks)
        stopper.join(timeout=60)
    finally:
        if gateway.process is not None:
            gateway.process.send_signal(signal.SIGKILL)
    finishes = [ch.finish_reason for chunk in [first, *rest] for ch in chunk.choices
                if ch.finish_reason]
    # The whole answer: its finish reason and its usage chunk came after SIGTERM.
    assert len(finishes) == 1 and rest[-1].usage is not None
    assert rest[-1].usage.completion_tokens > 1
    assert stopped == [0], log.read_text()
    assert process.poll() == 0


@pytest.mark.parametrize("options, words", [
    (("--url", "http://127.0.0.1:8000"), "talks to Triton over gRPC"),
    (("--port", "0"), "not a TCP port"),
    (("--max-concurrency", "0"), "must be at least 1"),
    (("--port", "BUSY"), "cannot listen on 127.0.0.1:"),
])
def test_bad_options_are_refused_in_one_line(options, words) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = run_cli("gateway", "--host", "127.0.0.1",
                         *(port if o == "BUSY" else o for o in options), timeout=60)
    assert result.returncode == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_the_gateway_takes_tritons_grpc_address_and_refuses_http() -> None:
    from qvl_trt.errors import ConfigError
    from qvl_trt.gateway.options import triton_grpc_address

    assert triton_grpc_address("grpc://10.0.0.2:8001") == "10.0.0.2:8001"
    with pytest.raises(ConfigError, match="talks to Triton over gRPC; pass grpc://"):
        triton_grpc_address("http://127.0.0.1:8000")


def test_a_gateway_started_by_serve_answers_serves_readiness(triton_server) -> None:
    """With `ready_url` (what `qvl-trt serve --openai-port` passes), the gateway's /ready is
    the supervisor's answer, not Triton's: here a stand-in supervisor that says not ready
    while Triton's models are all ready, then ready, then nothing at all."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.gateway.readiness import ask_ready, ready_reply
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    answer = [(False, "restarting: python model instance x died")]

    class Supervisor(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = ready_reply(*answer[0])
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    health = ThreadingHTTPServer(("127.0.0.1", 0), Supervisor)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    ready_url = f"http://127.0.0.1:{health.server_address[1]}/ready"
    opts = GatewayOptions(triton_server.grpc_url, host="127.0.0.1", port=free_ports().http,
                          ready_url=ready_url)
    with GatewayProcess(opts) as gateway:
        deadline = time.monotonic() + 60
        while (state := gateway.readiness()) is None or "looking for" in state[1]:
            assert time.monotonic() < deadline, state  # discovery first
            time.sleep(0.1)
        assert state == (False, "restarting: python model instance x died")
        answer[0] = (True, "ready")
        assert gateway.readiness() == (True, "ready") == ask_ready(ready_url, 5)
        health.shutdown()
        health.server_close()
        ok, reason = gateway.readiness()
        assert not ok and ready_url in reason
