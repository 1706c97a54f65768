"""`qvl-trt serve` under faults (qvl_trt/serve/supervisor.py, server.py), each test with its
own `qvl-trt serve` process on the reference repository of the tiny build: a killed python
stub is noticed and the server restarted, readiness says so in between; kill -9 of serve
leaves nothing running; SIGTERM drains in-flight requests and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qvl_trt.testing.processes import group_alive, group_gone_within
from qvl_trt.triton import contract as c

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")
pytest.importorskip("torch", reason="the reference flavor runs PyTorch: pip install "
                    "'qvl-trt[export]'")

STARTUP_S = 180


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_build: Path) -> Path:
    from qvl_trt.machine import find_tritonserver
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    if find_tritonserver() is None:
        pytest.skip("needs a tritonserver: pip install 'qvl-trt[serve]' (nvidia-pytriton)")
    return write_repo([BuildInput(tiny_build)], tmp_path_factory.mktemp("sup") / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  vision_cache_mib=16)).path


class Serve:
    """A `qvl-trt serve` child process with a readiness port."""

    def __init__(self, repo: Path, tmp: Path, *options: str) -> None:
        from qvl_trt.serve.server import free_ports

        self.ports, self.health = free_ports(), free_ports().http
        self.log = tmp / "server.log"  # tritonserver's
        self.serve_log = tmp / "serve.log"  # serve's own: the supervisor's lines
        with open(self.serve_log, "wb") as out:  # a file: a pipe nobody reads fills up
            self.process = subprocess.Popen(
                [sys.executable, "-m", "qvl_trt.cli", "serve", str(repo), "--host",
                 "127.0.0.1", "--http-port", str(self.ports.http), "--grpc-port",
                 str(self.ports.grpc), "--metrics-port", str(self.ports.metrics),
                 "--health-port", str(self.health), "--log-file", str(self.log), *options],
                stdout=out, stderr=subprocess.STDOUT)
        self.http = f"127.0.0.1:{self.ports.http}"
        self.grpc = f"127.0.0.1:{self.ports.grpc}"

    def ready(self) -> bool:
        state = self.state()
        return state is not None and state["ready"]

    def state(self) -> dict | None:
        """serve's GET /ready body (ready, reason, restarts), or None while it does not
        answer."""
        from qvl_trt.gateway.readiness import ready_state

        return ready_state(f"http://127.0.0.1:{self.health}/ready", 10)

    def wait_restarted(self, before: int, timeout_s: float = STARTUP_S) -> None:
        """Until serve says it restarted the server (its own signal that it noticed a
        fault: readiness alone lags a death by up to its watch interval) and is ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state is not None and state["restarts"] > before and state["ready"]:
                assert state["restarts"] == before + 1, state
                return
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, f"serve did not restart: {state}"
            time.sleep(0.05)

    def wait_ready(self, timeout_s: float = STARTUP_S) -> float:
        began = time.monotonic()
        while not self.ready():
            assert self.process.poll() is None, self.output()
            assert time.monotonic() - began < timeout_s, "serve was not ready in time"
            time.sleep(0.1)
        return time.monotonic() - began

    def tritonserver(self) -> int:
        """The pid of serve's tritonserver (its child, leader of its own process group)."""
        return self.child(lambda stat, argv: "(tritonserver)" in stat, "tritonserver")

    def gateway(self) -> int:
        """The pid of serve's gateway (`--openai-port`; leader of its own process group)."""
        return self.child(lambda stat, argv: b"gateway" in argv, "gateway")

    def child(self, match, what: str) -> int:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if match(stat, argv) and \
                        int(stat[stat.rindex(")") + 2:].split()[1]) == self.process.pid:
                    return int(entry.name)
        raise AssertionError(f"serve runs no {what}")

    def output(self) -> str:
        """The ends of serve's and tritonserver's logs."""
        return "\n".join(path.read_text(errors="replace")[-3000:]
                         for path in (self.serve_log, self.log) if path.is_file())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc) -> None:
        """Kill it if it still runs; remove the /dev/shm regions it could not."""
        from qvl_trt.serve.server import remove_stale_shm

        self.close()
        time.sleep(0.5)
        remove_stale_shm()


# The token generator's rate in the slow repository: an answer of N tokens takes at least
# N / SLOW_TOKENS_PER_S seconds, however fast the machine.
SLOW_TOKENS_PER_S = 20.0


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory, tiny_build: Path, repo: Path) -> Path:
    """The reference repository with tensorrt_llm replaced by the token generator: answers
    whose least duration is known."""
    from qvl_trt.testing.token_generator import install_token_generator
    from qvl_trt.triton.layout import VERSION

    slow = tmp_path_factory.mktemp("slow") / "repo"
    shutil.copytree(repo, slow)
    install_token_generator(slow / c.TENSORRT_LLM / VERSION, SLOW_TOKENS_PER_S)
    return slow


@pytest.fixture
def serve(repo: Path, tmp_path: Path):
    with Serve(repo, tmp_path) as started:
        yield started


def generate(serve: Serve, max_tokens: int) -> str:
    body = {c.TEXT_INPUT: "Count.", c.MAX_TOKENS: max_tokens, c.TEMPERATURE: 0.0,
            c.STREAM: False}
    request = urllib.request.Request(f"http://{serve.http}/v2/models/{c.ENSEMBLE}/generate",
                                     data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())[c.TEXT_OUTPUT]


def stream_inputs(max_tokens: int) -> list:
    inputs = []
    for name, value, dtype in (
            (c.TEXT_INPUT, np.array([[b"Count."]], object), "BYTES"),
            (c.MAX_TOKENS, np.array([[max_tokens]], np.int32), "INT32"),
            (c.TEMPERATURE, np.array([[0.0]], np.float32), "FP32"),
            (c.STREAM, np.array([[True]]), "BOOL"),
            (c.IGNORE_EOS, np.array([[True]]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


class Stream:
    """One streamed gRPC request; its client stays open until close() (as a client library
    keeping its stream would)."""

    def __init__(self, serve: Serve, max_tokens: int, model: str = c.ENSEMBLE) -> None:
        self.events: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(serve.grpc)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.client.async_stream_infer(model, stream_inputs(max_tokens),
                                       enable_empty_final_response=True)

    def next(self, timeout_s: float = 60):
        result, error = self.events.get(timeout=timeout_s)
        if error is not None:
            return "error", str(error)
        final = result.get_response().parameters.get("triton_final_response")
        return ("final" if final is not None and final.bool_param else "token"), result

    def finish(self, timeout_s: float = 60) -> int:
        """Read to the final response; the answer's token count (completion_tokens: a
        response may carry several tokens)."""
        while True:
            kind, result = self.next(timeout_s)
            assert kind != "error", result
            if kind == "final":
                return int(result.as_numpy(c.COMPLETION_TOKENS).reshape(-1)[0])

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@contextlib.contextmanager
def open_streams(serve: Serve, count: int, max_tokens: int) -> Iterator[list[Stream]]:
    streams = [Stream(serve, max_tokens) for _ in range(count)]
    try:
        yield streams
    finally:
        for stream in streams:
            stream.close()


def warm_images(serve: Serve) -> float:
    """The images the vision encoder has encoded since its server started (its cache's misses):
    the health probes send none."""
    from qvl_trt.serve.progress import read_metrics, total

    samples = read_metrics(f"http://127.0.0.1:{serve.ports.metrics}/metrics")
    assert samples is not None, serve.output()
    return total(samples, "qvl_vision_cache_misses_total")


def test_a_killed_stub_is_noticed_and_service_comes_back(serve: Serve, repo: Path) -> None:
    """Also: each start warms the models up before ready (one image through the ensemble
    before any client's request) and adds to the repository's load-time record."""
    from qvl_trt.serve.load_time import read_load_time
    from qvl_trt.serve.server import STUB_NAME

    before = read_load_time(repo)
    serve.wait_ready()
    assert warm_images(serve) == 1, serve.output()
    assert "warmed up ensemble in" in serve.serve_log.read_text()
    recorded = read_load_time(repo)
    assert recorded is not None and recorded.starts == (before.starts if before else 0) + 1
    assert recorded.slowest_s > 0
    want = generate(serve, 8)
    # Every stub is watched alike (Supervisor._stubs, a pid per model instance): an idle one
    # that holds the admission places and the one streaming the answer stand for the rest.
    for model in ("postprocessing", "tensorrt_llm"):
        server = serve.tritonserver()
        stubs = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                 and _is_stub_of(p, server, f"{model}_0_0", STUB_NAME)]
        assert len(stubs) == 1, model
        inflight = Stream(serve, 600)
        assert inflight.next()[0] == "token"
        restarts = serve.state()["restarts"]
        os.kill(stubs[0], signal.SIGKILL)
        killed = time.monotonic()
        # A hang would be the fault (a dead stub's requests never end on their own); how
        # quickly serve notices is printed, not asserted (no timed assertions).
        while inflight.next(timeout_s=STARTUP_S)[0] == "token":
            pass  # the rest of the answer, up to the error
        errored = time.monotonic() - killed
        inflight.close()
        serve.wait_restarted(restarts)  # one restart, noticed and over
        back = time.monotonic() - killed
        assert warm_images(serve) == 1  # the restarted server was warmed up too
        got = generate(serve, 8)
        print(f"{model}: in-flight error after {errored:.2f} s, ready after {back:.1f} s")
        assert got == want
    # Prometheus sees both restarts and the readiness, as the dashboard and alerts query them.
    from test_deploy_monitoring import missing_series
    from test_serve_server import samples_at

    from qvl_trt.deploy.monitoring import Source
    from qvl_trt.gateway.readiness import SERVE_READY, SERVE_RESTARTS

    samples = samples_at(f"http://127.0.0.1:{serve.health}/metrics")
    assert samples == {(SERVE_RESTARTS, frozenset()): 2, (SERVE_READY, frozenset()): 1}
    assert missing_series(samples, {Source.SERVE}) == []


def _is_stub_of(proc: Path, server: int, instance: str, stub: str) -> bool:
    try:
        stat = (proc / "stat").read_text()
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return int(stat[stat.rindex(")") + 2:].split()[1]) == server and \
        argv[0].endswith(stub.encode()) and instance.encode() in argv


def test_kill_9_of_serve_leaves_nothing_running(serve: Serve) -> None:
    """With answers in flight, through the ensemble and tensorrt_llm_bls: stubs busy with a
    request ran on orphaned before they watched their server (runtime/backend.py
    exit_with_server)."""
    from qvl_trt.serve.server import SHM_DIR, remove_stale_shm

    serve.wait_ready()
    server = serve.tritonserver()
    assert group_alive(server)
    with open_streams(serve, 3, 600) as streams:
        bls = Stream(serve, 600, model=c.TENSORRT_LLM_BLS)
        for stream in (*streams, bls):
            assert stream.next()[0] == "token"
        prefix = f"qvl{serve.process.pid}x"
        assert list(SHM_DIR.glob(f"{prefix}*")), "no shm of this run: the prefix is wrong"
        serve.process.kill()
        serve.process.wait()
        assert group_gone_within(server), "tritonserver or a stub outlived serve"
        bls.close()
    # What the killed serve leaves, the next start removes: here or in a serve that another
    # test starts meanwhile (the same sweep), so the files were looked for before the kill.
    remove_stale_shm()
    assert not list(SHM_DIR.glob(f"{prefix}*"))


def test_sigterm_before_ready_stops_tritonserver(serve: Serve) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            server = serve.tritonserver()
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    serve.process.send_signal(signal.SIGTERM)
    serve.process.wait(timeout=60)
    # As for kill -9 of serve: nothing of it runs 30 s later.
    assert group_gone_within(server), "SIGTERM before ready orphaned tritonserver"


def wait_for_new_gateway(serve: Serve, crashed: int, port: int) -> int:
    """The pid of the gateway serve started after `crashed` died, once it answers ready."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        assert serve.process.poll() is None, serve.output()
        assert time.monotonic() < deadline, "serve did not start the gateway again"
        try:
            pid = serve.gateway()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as reply:
                if pid != crashed and reply.status == 200:
                    return pid
        except (AssertionError, urllib.error.URLError, OSError):
            pass  # not started yet, or not listening yet
        time.sleep(0.2)


def test_sigterm_drains_eight_streams_stops_the_gateway_and_exits_0(slow_repo: Path,
                                                                      tmp_path: Path) -> None:
    """The clients keep their gRPC streams open: in Triton 2.51 that holds the ensemble
    loaded until its exit timeout (see DRAINED_LINE in server.py). The answers outlast the
    default drain budget (and the exit timeout Triton would have had with it), which
    --drain-timeout raises: all of them finish and serve exits 0. With --openai-port the
    gateway answers once the server is ready, comes back after a kill -9, and ends before the
    server."""
    from qvl_trt.gateway.readiness import ask_ready
    from qvl_trt.serve.server import ServerOptions, free_ports

    openai = pytest.importorskip("openai", reason="the gateway's client: pip install openai")
    port = free_ports().http
    with Serve(slow_repo, tmp_path, "--openai-port", str(port), "--drain-timeout",
               "90") as serve:
        serve.wait_ready()
        # one readiness on both ports: the gateway forwards serve's once it has found the
        # builds Triton serves (serve's readiness waits for the gateway to listen)
        deadline = time.monotonic() + 60
        while (gateway_ready := ask_ready(f"http://127.0.0.1:{port}/ready", 5)) != \
                (True, "ready"):
            assert time.monotonic() < deadline, gateway_ready
            time.sleep(0.1)
        assert ask_ready(f"http://127.0.0.1:{serve.health}/ready", 5) == gateway_ready
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        answer = api.chat.completions.create(
            model=c.ENSEMBLE, messages=[{"role": "user", "content": "Count."}], max_tokens=4,
            temperature=0)
        assert answer.choices[0].message.content == generate(serve, 4)
        crashed = serve.gateway()
        os.kill(crashed, signal.SIGKILL)  # a crash: serve starts it again on the same port
        gateway = wait_for_new_gateway(serve, crashed, port)
        again = api.chat.completions.create(
            model=c.ENSEMBLE, messages=[{"role": "user", "content": "Count."}], max_tokens=4,
            temperature=0)
        assert again.choices[0].message.content == answer.choices[0].message.content
        tokens_each = int(SLOW_TOKENS_PER_S * (ServerOptions.drain_timeout_s + 2))
        with open_streams(serve, 8, tokens_each) as streams:
            for stream in streams:
                assert stream.next()[0] == "token"
            serve.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            tokens = [stream.finish(timeout_s=120) for stream in streams]
            # all of them, though SIGTERM came and the drain outlasted the default budget
            assert tokens == [tokens_each] * 8
            assert time.monotonic() - signalled > ServerOptions.drain_timeout_s
            code = serve.process.wait(timeout=120)
    log = serve.output()
    assert code == 0, log
    assert "Exit timeout expired" not in log
    assert not group_alive(gateway), "the gateway outlived serve"


def test_a_second_sigterm_cuts_the_drain_and_exits_1(slow_repo: Path, tmp_path: Path) -> None:
    """The first SIGTERM starts the drain of answers that would take half a minute; the second
    ends it at once: the answers stop with an error, serve exits 1, nothing is left."""
    with Serve(slow_repo, tmp_path, "--drain-timeout", "120") as serve:
        serve.wait_ready()
        server = serve.tritonserver()
        with open_streams(serve, 2, int(SLOW_TOKENS_PER_S * 30)) as streams:
            for stream in streams:
                assert stream.next()[0] == "token"
            serve.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the first one is handled; the order is what matters
            serve.process.send_signal(signal.SIGTERM)
            code = serve.process.wait(timeout=60)
            ends = []
            for stream in streams:
                while (kind := stream.next(timeout_s=60)[0]) == "token":
                    pass
                ends.append(kind)
    assert code == 1, serve.output()
    assert ends == ["error", "error"]
    assert group_gone_within(server), "a forced stop left tritonserver running"
