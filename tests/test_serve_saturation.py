"""`qvl-trt serve` under saturation and through a restart, on the reference repository with
the token generator as tensorrt_llm (answers of a known least duration): more long answers
than batch slots through the gateway and the ensemble are all served while the supervisor
sees a busy server, not a dead one; past the build's places requests are refused at once; a
restart reaches gateway clients as HTTP answers. Outcomes and counts, no timings."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_serve_server import samples_at
from test_serve_supervisor import (
    SLOW_TOKENS_PER_S,
    STARTUP_S,
    Serve,
    Stream,
    _is_stub_of,
)

from qvl_trt.testing.processes import group_gone_within
from qvl_trt.triton import contract as c

# The tiny profile's tensorrt_llm has 8 batch slots; this repository admits 8 more requests
# to wait for one (`qvl-trt repo --max-queue 8`), and refuses the rest as busy.
SLOTS, QUEUE = 8, 8


@pytest.fixture(scope="module")
def saturation_repo(tmp_path_factory, tiny_build: Path) -> Path:
    """The reference repository with a queue of QUEUE places and the token generator as
    tensorrt_llm (answers of a known least duration)."""
    from qvl_trt.testing.token_generator import install_token_generator
    from qvl_trt.triton.layout import VERSION
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    repo = write_repo([BuildInput(tiny_build)], tmp_path_factory.mktemp("sat") / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  vision_cache_mib=16, max_queue=QUEUE)).path
    install_token_generator(repo / c.TENSORRT_LLM / VERSION, SLOW_TOKENS_PER_S)
    return repo


def server_total(serve: Serve, name: str, **labels: str) -> float:
    from qvl_trt.serve.progress import total

    return total(samples_at(f"http://127.0.0.1:{serve.ports.metrics}/metrics"), name,
                 **labels)


def openai_stream(api, tokens: int) -> tuple[str, object]:
    """One streamed chat answer through the gateway, long (ignore_eos, as benchmarks load a
    server): ("done", completion tokens), ("refused", the 429) or ("error", what else)."""
    import openai

    try:
        usage = None
        with api.chat.completions.create(
                model=c.ENSEMBLE, messages=[{"role": "user", "content": "Count."}],
                max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as s:
            for chunk in s:
                usage = chunk.usage or usage
        return "done", usage.completion_tokens
    except openai.RateLimitError as exc:
        return "refused", exc
    except openai.OpenAIError as exc:
        return "error", exc


def ensemble_stream(serve: Serve, tokens: int) -> tuple[str, object]:
    """The same through the ensemble, over gRPC: a refusal is an error response whose text
    carries the busy marker."""
    stream = Stream(serve, tokens)
    try:
        kind, result = stream.next(timeout_s=STARTUP_S)
        while kind == "token":
            kind, result = stream.next(timeout_s=STARTUP_S)
        if kind == "final":
            return "done", int(result.as_numpy(c.COMPLETION_TOKENS).reshape(-1)[0])
        refused = c.ErrorKind.of_message(result) is c.ErrorKind.BUSY
        return ("refused" if refused else "error"), result
    finally:
        stream.close()


def test_saturation_serves_every_admitted_answer_refuses_the_rest_and_restarts_nothing(
        saturation_repo: Path, tmp_path: Path) -> None:
    """Long answers through the gateway and the ensemble at twice the batch slots: the probe
    waits for a slot about one answer, longer than the stall timeout, while tokens flow:
    busy, not dead, so no restart and readiness stays true (serve's rule before restarted
    the server here: test_serve_liveness.old_rule). Then every place taken by answers that
    cannot end during the test: each further request is refused at once, 429 through the
    gateway and a busy error through the ensemble, and the places come back when those
    clients go away. SIGTERM then ends serve with 0 and nothing of it left running."""
    openai = pytest.importorskip("openai", reason="the gateway's client: pip install openai")
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    tokens = int(SLOW_TOKENS_PER_S * 6)  # 6 s an answer, twice the stall timeout
    with Serve(saturation_repo, tmp_path, "--openai-port", str(port), "--probe-interval",
               "0.5", "--stall-timeout", "3", "--drain-timeout", "60") as serve:
        serve.wait_ready()
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0, timeout=STARTUP_S)
        wait_gateway_ready(serve, port)
        with ThreadPoolExecutor(max_workers=2 * (SLOTS + QUEUE)) as pool:
            runs = [pool.submit(openai_stream, api, tokens) for _ in range(SLOTS)]
            runs += [pool.submit(ensemble_stream, serve, tokens) for _ in range(SLOTS)]
            outcomes = [run.result(timeout=STARTUP_S) for run in runs]
        assert outcomes == [("done", tokens)] * (2 * SLOTS), outcomes
        state = serve.state()
        assert state["ready"] and state["restarts"] == 0, state
        # serve's log, as its console wraps it: its own record of how long each probe took
        waits = [float(w) for w in re.findall(
            r"the\s+probe\s+of\s+ensemble\s+answered\s+after\s+([0-9.]+)\s+s",
            serve.serve_log.read_text())]
        assert max(waits, default=0) > 3, waits  # it did wait past the stall timeout

        # Every place taken by answers of 45 s; the fillers go through the gateway, whose
        # client leaving cancels them (the ensemble passes no cancel to a running step).
        refused_before = server_total(serve, "qvl_llm_requests_refused_total",
                                      reason="queue_full")
        fillers = [FillerStream(port) for _ in range(SLOTS + QUEUE)]
        try:
            until(lambda: server_total(serve, "qvl_llm_requests_running") == SLOTS and
                  server_total(serve, "qvl_llm_requests_waiting") == QUEUE)
            extras = [openai_stream(api, 4) for _ in range(2)] + \
                [ensemble_stream(serve, 4) for _ in range(2)]
        finally:
            for filler in fillers:
                filler.close()
        assert [kind for kind, _ in extras] == ["refused"] * 4, extras
        # the gateway holds what the build admits, and refuses the rest itself
        assert extras[0][1].response.headers["Retry-After"] == "1"
        assert "16 requests are being answered, the limit of this gateway" in \
            str(extras[0][1])
        # the ensemble's clients share the build's places: its caller refuses them
        assert "busy: tensorrt_llm has 8 batch slots and 8 places in its queue" in \
            extras[2][1]
        assert server_total(serve, "qvl_llm_requests_refused_total",
                            reason="queue_full") == refused_before + 2
        until(lambda: server_total(serve, "qvl_llm_requests_running") == 0 and
              server_total(serve, "qvl_llm_requests_waiting") == 0)
        assert openai_stream(api, 4) == ("done", 4)
        assert serve.state()["restarts"] == 0
        server = serve.tritonserver()
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=120) == 0, serve.output()
    assert group_gone_within(server), "tritonserver outlived serve"


class FillerStream:
    """A streamed chat request through the gateway, read by nobody, until close() drops its
    connection (the client goes away)."""

    def __init__(self, port: int, tokens: int = int(SLOW_TOKENS_PER_S * 45)) -> None:
        import http.client

        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STARTUP_S)
        body = {"model": c.ENSEMBLE, "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": tokens, "stream": True, "ignore_eos": True}
        self.connection.request("POST", "/v1/chat/completions", json.dumps(body),
                                {"Content-Type": "application/json"})

    def close(self) -> None:
        self.connection.close()


def until(condition, timeout_s: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.1)


def free_port() -> int:
    from qvl_trt.serve.server import free_ports

    return free_ports().http


def wait_gateway_ready(serve: Serve, port: int) -> None:
    from qvl_trt.gateway.readiness import ask_ready

    until(lambda: ask_ready(f"http://127.0.0.1:{port}/ready", 10) == (True, "ready"))


def test_through_the_gateway_a_restart_is_an_http_answer_never_a_reset(saturation_repo: Path,
                                                                        tmp_path: Path) -> None:
    """A stub dies under an answer being streamed through the gateway: that answer ends with
    an error event in OpenAI's shape; every request sent while serve restarts the server gets
    the gateway's 503 (OpenAI's shape, Retry-After), or its answer once the server is back:
    an HTTP answer each, never a reset connection."""
    openai = pytest.importorskip("openai", reason="the gateway's client: pip install openai")
    from concurrent.futures import ThreadPoolExecutor

    from qvl_trt.serve.server import STUB_NAME

    port = free_port()
    with Serve(saturation_repo, tmp_path, "--openai-port", str(port)) as serve:
        serve.wait_ready()
        wait_gateway_ready(serve, port)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0, timeout=STARTUP_S)
        with ThreadPoolExecutor(max_workers=1) as pool:
            chunks = api.chat.completions.create(
                model=c.ENSEMBLE, messages=[{"role": "user", "content": "Count."}],
                max_tokens=int(SLOW_TOKENS_PER_S * 45), stream=True,
                extra_body={"ignore_eos": True})
            next(iter(chunks))  # streaming
            inflight = pool.submit(lambda: list(chunks))
            restarts = serve.state()["restarts"]
            server = serve.tritonserver()
            (stub,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                       and _is_stub_of(p, server, f"{c.TENSORRT_LLM}_0_0", STUB_NAME)]
            os.kill(stub, signal.SIGKILL)
            with pytest.raises(openai.APIError) as ended:
                inflight.result(timeout=STARTUP_S)
        assert not isinstance(ended.value, openai.APIConnectionError), ended.value
        statuses, during = [], 0
        deadline = time.monotonic() + STARTUP_S
        while not ((state := serve.state()) and state["restarts"] > restarts and
                   state["ready"]):
            assert time.monotonic() < deadline, state
            during += bool(state and state["reason"].startswith("restarting"))
            statuses.append(raw_chat(port))
            time.sleep(0.05)
        # Ready again: the gateway's channel reconnects within a second (its backoff).
        while (answer := raw_chat(port))[0] != 200:
            assert time.monotonic() < deadline, answer
            statuses.append(answer)
            time.sleep(0.05)
        statuses.append(answer)
    print(f"{len(statuses)} requests while the server restarted, by status: "
          f"{collections.Counter(status for status, _, _ in statuses)}")
    assert during >= 1, "no request was sent while serve restarted the server"
    assert {status for status, _, _ in statuses} <= {200, 503}, statuses
    for status, retry_after, body in statuses:
        if status == 503:
            assert retry_after == "1" and body["error"]["code"] == "unavailable", body


def raw_chat(port: int) -> tuple[int, str | None, dict]:
    """A chat request as plain HTTP: its status, Retry-After and JSON body; a connection that
    is reset or refused raises."""
    body = {"model": c.ENSEMBLE, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=STARTUP_S) as reply:
            return reply.status, reply.headers.get("Retry-After"), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After"), json.loads(exc.read())
