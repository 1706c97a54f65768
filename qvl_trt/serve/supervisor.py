"""`qvl-trt serve`'s supervision of a running tritonserver.

Triton 2.51's python backend never restarts a stub that died (OOM kill, segfault): every
later request to that model fails with "Stub process 'X_0_0' is not healthy", requests in
flight to it never end, and /v2/health/ready stays 200. So serve watches the python backend
stubs (children of tritonserver, one per model instance; a dead one is seen within
`watch_interval_s`) and sends an end-to-end probe through each ensemble (`probe`), whose
outcomes and the server's reported progress tell a busy server from a dead one
(serve/liveness.py: a probe that waits while the server produces is busy, never a fault).
A fault (a dead process or stub, failing probes, a wedged server) restarts the whole server
on the same ports: its process group is killed, so every request in flight ends at once
with a connection error (the dead stub's requests included), and until the new server has
loaded its models clients get connection refused (through the gateway: a 503). A model
reload through the repository API is not used: it needs explicit model control, and
unloading a model waits for its in-flight requests, which a dead stub never finishes.

Companions (the OpenAI gateway of `--openai-port`) start once the server is ready, stop
before it (their answers in flight finish first), and are started again when one exits on its
own (a crash, an OOM kill), at most every `companion_retry_s`; a server restart leaves them
running (the gateway finds the new server on the same ports).

Each start, before the first probe, sends the warm-up request through each ensemble
(serve/warmup.py, unless turned off) so that the first client's request finds the models
warm, and reports how long the start took (`on_loaded`: serve keeps the slowest in the
repository, serve/load_time.py).

Readiness (`--health-port`, gateway/readiness.py): GET /ready answers 200 once a probe has
answered and while none has failed since (a busy server is ready), every stub is alive,
every companion has started and runs and no restart is under way, 503 (with the reason)
otherwise; its body also counts the restarts so far. GET /live answers 200 while serve runs.
GET /metrics gives both to Prometheus (gateway/readiness.py serve_metrics).
The gateway serve starts forwards this answer on its own port.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from ..errors import ServerError
from ..gateway.readiness import (
    LIVE_PATH,
    METRICS_PATH,
    READY,
    READY_PATH,
    live_reply,
    ready_reply,
    serve_metrics,
)
from ..triton import contract as c
from .liveness import Liveness, LivenessRules, Outcome
from .progress import progress_counters, read_metrics
from .server import STARTUP_TIMEOUT_S, TritonServer, family
from .warmup import warm_up

log = logging.getLogger(__name__)

PROBE_PROMPT = "Hi"
# A server that fails to start is tried START_ATTEMPTS times, START_RETRY_S apart (a port
# a killed server held may take a moment to free), before serve gives up.
START_ATTEMPTS = 3
START_RETRY_S = 2.0
# Past the probe deadline, before the probe's own connection gives up (the deadline decides).
PROBE_GRACE_S = 30.0
DEFAULT_RULES = LivenessRules()


def probe(server: TritonServer, ensemble: str, timeout_s: float) -> tuple[Outcome, str]:
    """One greedy one-token text request through `ensemble`, as a health probe (it does not
    queue for a batch slot: contract.HEALTH_PROBE): its outcome, and what went wrong."""
    body = {c.TEXT_INPUT: PROBE_PROMPT, c.MAX_TOKENS: 1, c.TEMPERATURE: 0.0, c.STREAM: False,
            c.HEALTH_PROBE: True}
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{ensemble}/generate",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:300]
        busy = c.ErrorKind.of_message(text) is c.ErrorKind.BUSY
        return (Outcome.BUSY if busy else Outcome.FAILED), f"{ensemble}: HTTP {exc.code} {text}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Outcome.FAILED, f"{ensemble}: {exc}"
    if c.TEXT_OUTPUT in answer:
        return Outcome.ANSWERED, ""
    return Outcome.FAILED, f"{ensemble}: no {c.TEXT_OUTPUT} in {answer}"


class HealthServer(ThreadingHTTPServer):
    """/ready and /live on an IPv4 or IPv6 address (`::` takes IPv4 clients too: Linux's
    dual-stack sockets), as an IPv6 single-stack cluster's kubelet probes them."""

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        self.address_family = family(address[0])
        super().__init__(address, handler)


class Companion(Protocol):
    """A process serve runs beside tritonserver (serve.gateway_process.GatewayProcess)."""

    name: str

    def start(self) -> object:
        """Start it; return once it serves, or raise ServerError."""

    def stop(self) -> int | None:
        """Stop it (its answers in flight finish first); harmless when it is not running."""

    def exit_code(self) -> int | None:
        """Its exit code once it has ended on its own; None while it runs."""


class Supervisor:
    def __init__(self, server: TritonServer, ensembles: tuple[str, ...], *,
                 health_port: int | None = None, health_host: str | None = None,
                 watch_interval_s: float = 0.5, rules: LivenessRules = DEFAULT_RULES,
                 start_attempts: int = START_ATTEMPTS,
                 companions: Sequence[Companion] = (), companion_retry_s: float = 5.0,
                 warm: bool = True, on_loaded=None, on_ready=None) -> None:
        self.server = server
        self.ensembles = ensembles
        self.health_port = health_port
        self.health_host = health_host  # None: the server's
        self.watch_interval_s = watch_interval_s
        self.rules = rules
        self.start_attempts = start_attempts
        self.companions = tuple(companions)
        self.companion_retry_s = companion_retry_s
        self.warm = warm  # the warm-up request through each ensemble at each start
        self.on_loaded = on_loaded  # called with each start's seconds, launch to warmed up
        self.on_ready = on_ready  # called once, when the server and companions first serve
        self.restarts = 0
        self._lock = threading.Lock()
        self._generation = 0  # bumped by each (re)start: older probe results are void
        self._liveness = Liveness(rules, time.monotonic())
        self._reason = "starting"
        self._stubs: dict[str, int] = {}
        self._stopping = threading.Event()
        self._probe_now = threading.Event()
        self._health: ThreadingHTTPServer | None = None
        self._companion_retry: dict[int, float] = {}  # index -> when to try starting it again
        self._companions_started = threading.Event()
        if not self.companions:
            self._companions_started.set()

    # ---- readiness ------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        if not self._companions_started.is_set():
            return False, f"starting {', '.join(c.name for c in self.companions)}"
        for companion in self.companions:
            if companion.exit_code() is not None:
                return False, f"{companion.name} exited; starting it again"
        with self._lock:
            if self._reason:
                return False, self._reason
            ok, reason = self._liveness.readiness()
            return ok, READY if ok else reason

    def _start_health(self) -> None:
        if self.health_port is None:
            return
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == METRICS_PATH:
                    ok, _ = supervisor.readiness()
                    return self._send(200, serve_metrics(ok, supervisor.restarts),
                                      "text/plain; version=0.0.4; charset=utf-8")
                if self.path == LIVE_PATH:
                    code, body = live_reply()
                elif self.path == READY_PATH:
                    code, body = ready_reply(*supervisor.readiness(),
                                             restarts=supervisor.restarts)
                else:
                    code, body = 404, {"error": f"GET {READY_PATH}, {LIVE_PATH} or "
                                                f"{METRICS_PATH}"}
                self._send(code, json.dumps(body).encode(), "application/json")

            def _send(self, code: int, data: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        host = self.health_host or self.server.opts.host
        self._health = HealthServer((host, self.health_port), Handler)
        threading.Thread(target=self._health.serve_forever, name="health",
                         daemon=True).start()

    # ---- the loops ------------------------------------------------------------------------

    def run(self) -> int:
        """Start the server, supervise it until SIGTERM or Ctrl-C, then stop it (a second
        signal kills it). Returns the server's exit code."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            signal.signal(s, _raise_interrupt)  # before ready: the finally stops what began
        try:
            self._start_health()
            self._start()
            # Before the companions: a gateway forwards this readiness, which a probe makes.
            threading.Thread(target=self._probe_loop, name="probe", daemon=True).start()
            for companion in self.companions:
                companion.start()
            self._companions_started.set()
            if self.on_ready is not None:
                self.on_ready()
            for s in previous:
                signal.signal(s, self._on_signal)
            while not self._stopping.is_set():
                fault = self._fault()
                if fault:
                    self._restart(fault)
                self._watch_companions()
                self._stopping.wait(self.watch_interval_s)
            with self._lock:
                self._reason = "stopping"
            self._stop_companions()  # first: their answers in flight finish
            log.info("stopping tritonserver")
            return self.server.stop() or 0
        finally:
            self._stopping.set()
            self._probe_now.set()
            self._stop_companions()
            self.server.stop()  # a no-op after the stop above; else an error or a signal
            if self._health is not None:
                self._health.shutdown()
                self._health.server_close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if self._stopping.is_set():
            log.warning("second %s: killing tritonserver", signal.Signals(signum).name)
            self.server.kill()
        self._stopping.set()

    def _start(self) -> None:
        for attempt in range(1, self.start_attempts + 1):
            began = time.monotonic()
            try:
                self.server.start()
                break
            except ServerError as exc:
                if attempt == self.start_attempts:
                    raise
                log.warning("tritonserver did not start (attempt %d: %s); trying again",
                            attempt, exc)
                time.sleep(START_RETRY_S)
        if self.warm:
            self._warm_up()
        loaded = time.monotonic() - began
        log.info("tritonserver loaded%s in %.1f s", " and warmed up" if self.warm else "",
                 loaded)
        if self.on_loaded is not None:
            self.on_loaded(loaded)
        with self._lock:
            self._generation += 1
            self._stubs = self.server.stubs()
            self._liveness.restarted(time.monotonic())
            self._reason = ""
        self._probe_now.set()

    def _warm_up(self) -> None:
        """The warm-up request through each ensemble, one after the other. One that fails is
        logged and left: the probe that follows decides whether the server serves."""
        for ensemble in self.ensembles:
            began = time.monotonic()
            try:
                warm_up(self.server.http_url, ensemble, STARTUP_TIMEOUT_S)
            except ServerError as exc:
                log.warning("%s; the first request may be slow", exc)
            else:
                log.info("warmed up %s in %.1f s", ensemble, time.monotonic() - began)

    def _fault(self) -> str | None:
        code = self.server.process.poll() if self.server.process else -1
        if code is not None:
            return f"tritonserver exited with code {code}"
        alive = self.server.stubs()
        for name, pid in self._stubs.items():
            if alive.get(name) != pid:
                return f"python model instance {name} (pid {pid}) died"
        with self._lock:
            waiting = self._liveness.pending_since is not None
        # The progress counts only while a probe waits (liveness.py): read them then.
        samples = read_metrics(self.server.metrics_url) if waiting else None
        now = time.monotonic()
        with self._lock:
            self._liveness.progress(None if samples is None else progress_counters(samples),
                                    now)
            return self._liveness.fault(now)

    def _restart(self, reason: str) -> None:
        with self._lock:
            self._reason = f"restarting: {reason}"
            self._generation += 1
            self.restarts += 1  # /ready says so from now on: the fault is noticed
        log.warning("%s; restarting tritonserver on the same ports", reason)
        began = time.monotonic()
        self.server.stop(force=True)  # in-flight requests end now, with a connection error
        self._start()
        log.warning("tritonserver restarted in %.1f s", time.monotonic() - began)

    def _watch_companions(self) -> None:
        """Start again a companion that has ended on its own."""
        for index, companion in enumerate(self.companions):
            code = companion.exit_code()
            if code is None or time.monotonic() < self._companion_retry.get(index, 0.0):
                continue
            log.warning("%s exited with code %s; starting it again", companion.name, code)
            self._companion_retry[index] = time.monotonic() + self.companion_retry_s
            companion.stop()
            try:
                companion.start()
            except ServerError as exc:
                log.warning("%s; trying again in %.0f s", exc, self.companion_retry_s)
            else:
                log.warning("%s is back", companion.name)

    def _stop_companions(self) -> None:
        for companion in self.companions:
            companion.stop()

    def _probe_loop(self) -> None:
        """One probe at a time, through each ensemble in turn, `probe_interval_s` after the
        last one answered (at once after a start)."""
        timeout_s = self.rules.probe_deadline_s + PROBE_GRACE_S
        while not self._stopping.is_set():
            self._probe_now.wait(self.rules.probe_interval_s)
            self._probe_now.clear()
            for ensemble in self.ensembles:
                if self._stopping.is_set():
                    return
                with self._lock:
                    generation = self._generation
                    self._liveness.probe_sent(sent := time.monotonic())
                outcome, error = probe(self.server, ensemble, timeout_s)
                with self._lock:
                    if generation != self._generation:
                        break  # the server was restarted meanwhile: this answer is void
                    busy = self._liveness.busy(now := time.monotonic())
                    self._liveness.probe_done(outcome, now, error)
                if outcome is Outcome.FAILED:
                    log.warning("probe failed: %s", error)
                    break
                if busy:
                    log.info("the probe of %s %s after %.1f s: the server was busy, and "
                             "progressing", ensemble, outcome.value, now - sent)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
