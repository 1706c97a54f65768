"""The gateway as a child process (`qvl-trt serve --openai-port`, the demo, the benchmark):
`qvl-trt gateway` started in its own process group with PR_SET_PDEATHSIG, so it never outlives
the process that started it (kill -9 included); `stop()` sends SIGTERM (the answers in flight
finish, up to the shutdown timeout) and kills the group if it does not end in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..child import kill_group, popen_owned, signals_held
from ..errors import ServerError
from ..gateway.options import API_KEY_ENV, GatewayOptions
from ..gateway.readiness import READY_PATH, ask_ready
from ..triton.restricted import ADMIN_KEY_ENV
from .server import local_address

# Beyond the gateway's own shutdown timeout, before its group is killed.
STOP_GRACE_S = 5.0


def gateway_command(opts: GatewayOptions) -> list[str]:
    """`qvl-trt gateway` with these options, run by this interpreter."""
    cmd = [sys.executable, "-m", "qvl_trt.cli", "gateway", "--url", f"grpc://{opts.triton_url}",
           "--host", opts.host, "--port", str(opts.port),
           "--shutdown-timeout", str(opts.shutdown_timeout_s)]
    if opts.max_concurrency is not None:
        cmd += ["--max-concurrency", str(opts.max_concurrency)]
    if opts.max_queue is not None:
        cmd += ["--max-queue", str(opts.max_queue)]
    if opts.keys_file is not None:
        cmd += ["--keys-file", str(opts.keys_file)]
    if opts.max_body_bytes is not None:
        cmd += ["--max-body-bytes", str(opts.max_body_bytes)]
    if opts.ready_url is not None:
        cmd += ["--ready-url", opts.ready_url]
    cache = opts.answer_cache
    cmd += ["--answer-cache" if cache.enabled else "--no-answer-cache",
            "--answer-cache-entries", str(cache.max_entries),
            "--answer-cache-mib", f"{cache.max_mib:g}", "--answer-cache-ttl", f"{cache.ttl_s:g}",
            "--answer-cache-tools" if cache.tools else "--no-answer-cache-tools"]
    return cmd


class GatewayProcess:
    """The gateway child; a `serve.supervisor.Companion` of `qvl-trt serve`."""

    name = "the OpenAI gateway"

    def __init__(self, opts: GatewayOptions, *, log_file: Path | None = None) -> None:
        self.opts = opts
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Where clients on this machine reach it."""
        return f"http://{local_address(self.opts.host, self.opts.port)}"

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        """Start it and wait until it listens."""
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (the child's)
        # The keys go through the environment, not the command line (see API_KEY_ENV).
        keys = {API_KEY_ENV: self.opts.api_key, ADMIN_KEY_ENV: self.opts.triton_admin_key}
        env = {k: v for k, v in os.environ.items() if k not in keys}
        env.update({k: v for k, v in keys.items() if v is not None})
        try:
            with signals_held():  # a stop signal now is delivered once stop() can end it
                self.process = popen_owned(
                    gateway_command(self.opts), env=env, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the gateway exited with code {self.process.returncode} "
                                  f"while starting{self._log_hint()}")
            if self.readiness() is not None:
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"the gateway did not listen on {self.url} within {timeout_s:.0f} s"
                          f"{self._log_hint()}")

    def readiness(self) -> tuple[bool, str] | None:
        """GET /ready: (ready, reason), or None while it does not answer."""
        return ask_ready(f"{self.url}{READY_PATH}", timeout_s=10)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            state = self.readiness()
            if state is not None and state[0]:
                return
            time.sleep(0.2)
        raise ServerError(f"the gateway at {self.url} was not ready within {timeout_s:.0f} s "
                          f"({state[1] if state else 'no answer'})")

    def exit_code(self) -> int | None:
        """Its exit code once it has ended (without stop()); None while it runs or when it
        was never started."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> int | None:
        """SIGTERM, then the group killed after the shutdown timeout; the exit code (None when
        it was never started or is already stopped)."""
        if self.process is None:
            return None
        code = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=self.opts.shutdown_timeout_s + STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.process.pid)
        waited = self.process.wait()
        self.process = None
        return waited if code is None else code

    def _log_hint(self) -> str:
        return f"; see {self.log_file}" if self.log_file else ""

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
