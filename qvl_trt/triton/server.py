"""Starting and stopping tritonserver on a generated repository.

One rank: `tritonserver --model-repository=R ...` on the given (or free) ports with a per-run
shared-memory prefix for the python backend. Tensor-parallel engines (`world_size` N): one
rank per GPU through mpirun, as the TensorRT-LLM backend expects: rank 0 loads every model
and serves the endpoints; ranks > 0 load only the tensorrt_llm models (explicit model
control) and join rank 0 through MPI. Each rank gets its own shm prefix.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, DependencyError, ServerError
from ..machine import TritonInstall, find_tritonserver

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
STUB_NAME = "triton_python_backend_stub"
# The python backend's `thread-pool-size` default (its README): the server's threads that run
# BLS requests; a decoupled BLS call holds one until its first response, so more concurrent
# callers than threads queue their time to first token.
DEFAULT_THREAD_POOL = 32


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


@dataclass(frozen=True)
class ServerOptions:
    repo: Path
    ports: Ports = Ports()
    host: str = "127.0.0.1"
    world_size: int = 1
    # tensorrt_llm model names that ranks > 0 load (explicit model control)
    llm_models: tuple[str, ...] = ()
    shm_prefix: str = field(default_factory=lambda: new_shm_prefix())
    # python backend threads for BLS requests (serve sizes it from the repository)
    thread_pool_size: int = DEFAULT_THREAD_POOL
    exit_timeout_s: int = 10
    log_verbose: int = 0


def new_shm_prefix() -> str:
    """A prefix no other run uses, so this run's /dev/shm regions can be found and removed."""
    return f"qvl{os.getpid()}x{secrets.token_hex(3)}_"


def free_ports(host: str = "127.0.0.1") -> Ports:
    """Three ports free right now on `host` (bound together, then released)."""
    socks = []
    try:
        for _ in range(3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return Ports(*(s.getsockname()[1] for s in socks))
    finally:
        for s in socks:
            s.close()


def require_tritonserver() -> TritonInstall:
    install = find_tritonserver()
    if install is None:
        raise DependencyError(
            "no tritonserver found (PATH, /opt/tritonserver/bin, nvidia-pytriton); run inside "
            "the NGC Triton container or install one with: pip install 'qvl-trt[serve]'")
    return install


def prepare_tritonserver(install: TritonInstall) -> None:
    """Make the install able to run python models. The nvidia-pytriton wheel ships python
    backend stubs per Python version beside the backend instead of in it; the stub matching
    this interpreter is copied in (the documented pytriton recipe), once."""
    if install.origin != "pytriton":
        return
    _check_numpy()
    target = install.backends / "python" / STUB_NAME
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = install.binary.parent.parent / "python_backend_stubs" / version / STUB_NAME
    if target.is_file() and _same_file(source, target):
        return
    if not source.is_file():
        raise DependencyError(
            f"nvidia-pytriton has no python backend stub for Python {version} ({source}); "
            "use Python 3.8-3.13")
    tmp = target.with_name(f".{STUB_NAME}-{os.getpid()}")
    try:
        shutil.copy2(source, tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise DependencyError(
            f"cannot install the python backend stub into {target.parent} ({exc}); copy it "
            f"once by hand: cp {source} {target}") from None
    log.info("installed the Python %s backend stub into %s", version, target.parent)


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def _check_numpy() -> None:
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise DependencyError(
            f"numpy {numpy.__version__} breaks the python backend stub of Triton 2.51 (string "
            "inputs crash it); install numpy < 2: pip install 'numpy<2'")


def server_env(install: TritonInstall) -> dict[str, str]:
    """The environment for tritonserver (see `env_prepends`)."""
    env = dict(os.environ)
    for key, entry in env_prepends(install).items():
        env[key] = os.pathsep.join([entry, env[key]]) if env.get(key) else entry
    return env


def env_prepends(install: TritonInstall) -> dict[str, str]:
    """Search-path entries the pytriton build needs first: the python stub finds its
    interpreter (and so its packages) as `python3` on PATH, so this interpreter's bin folder;
    and it links libpython3.X by name, so this interpreter's own libpython (a system
    libpython of another patch release loads this interpreter's stdlib extensions and fails
    on missing symbols, e.g. in _ssl)."""
    if install.origin != "pytriton":
        return {}
    prepends = {"PATH": str(Path(sys.executable).parent)}
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        prepends["LD_LIBRARY_PATH"] = libdir
    return prepends


def rank_command(install: TritonInstall, opts: ServerOptions, rank: int) -> list[str]:
    """The tritonserver command line of one rank."""
    cmd = [
        str(install.binary), f"--model-repository={Path(opts.repo).resolve()}",
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name={opts.shm_prefix}r{rank}_",
        f"--backend-config=python,thread-pool-size={opts.thread_pool_size}",
        f"--http-port={opts.ports.http}", f"--grpc-port={opts.ports.grpc}",
        f"--metrics-port={opts.ports.metrics}",
        f"--http-address={opts.host}", f"--grpc-address={opts.host}",
        f"--metrics-address={opts.host}",
        f"--exit-timeout-secs={opts.exit_timeout_s}",
    ]
    if install.origin == "pytriton":
        cmd += [f"--backend-directory={install.backends}", "--allow-gpu-metrics=false"]
    if opts.log_verbose:
        cmd.append(f"--log-verbose={opts.log_verbose}")
    if rank > 0:
        # Ranks > 0 only run the TensorRT-LLM workers that rank 0's backend drives over MPI.
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={name}" for name in opts.llm_models]
    return cmd


def server_command(install: TritonInstall, opts: ServerOptions) -> list[str]:
    """The full command: one tritonserver, or mpirun with one rank per GPU."""
    if opts.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {opts.world_size}")
    if opts.world_size == 1:
        return rank_command(install, opts, 0)
    if not opts.llm_models:
        raise ConfigError("--world-size > 1 needs the repository's tensorrt_llm models; "
                          "this repository has none (reference flavor?)")
    cmd = ["mpirun"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for rank in range(opts.world_size):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", *rank_command(install, opts, rank)]
    return cmd


def format_command(cmd: list[str], install: TritonInstall) -> str:
    """The command as a shell line (with the PATH it needs), for --dry-run and logs."""
    prefix = "".join(f"{key}={shlex.quote(entry)}:${key} "
                     for key, entry in env_prepends(install).items())
    return prefix + shlex.join(cmd)


class TritonServer:
    """A running tritonserver. Use as a context manager, or call start() and stop()."""

    def __init__(self, opts: ServerOptions, *, install: TritonInstall | None = None,
                 log_file: Path | None = None, startup_timeout_s: float = 300.0) -> None:
        self.opts = opts
        self.install = install or require_tritonserver()
        self.log_file = log_file
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._log_handle = None

    @property
    def _client_host(self) -> str:
        # A server listening on every interface is reached through the loopback one.
        return "127.0.0.1" if self.opts.host in ("0.0.0.0", "") else self.opts.host

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.opts.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.opts.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.opts.ports.metrics}/metrics"

    def start(self) -> TritonServer:
        prepare_tritonserver(self.install)
        cmd = server_command(self.install, self.opts)
        log.info("starting: %s", format_command(cmd, self.install))
        if self.log_file is not None:
            self._log_handle = open(self.log_file, "ab")  # noqa: SIM115 (closed in stop)
        out = self._log_handle or None
        # Own session: a terminal's Ctrl-C reaches only us, and stop() can end the whole
        # group (the python backend stubs are the server's children).
        self.process = subprocess.Popen(cmd, env=server_env(self.install), stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"tritonserver exited with code {code} while loading "
                                  f"{self.opts.repo}{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerError(f"tritonserver was not ready after {self.startup_timeout_s:.0f} s"
                          f"{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        if self.log_file is None or not Path(self.log_file).is_file():
            return ""
        tail = Path(self.log_file).read_text(errors="replace").splitlines()[-lines:]
        return "; its log ends:\n" + "\n".join(tail)

    def stop(self) -> int | None:
        """SIGTERM (Triton drains and unloads), SIGKILL to the group if that takes too long,
        then remove this run's shared-memory files. Returns the exit code."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=self.opts.exit_timeout_s + 20)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver did not stop in time; killing it")
            _kill_group(self.process.pid)
            code = self.process.wait()
            self.process = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        remove_shm(self.opts.shm_prefix)
        return code

    def wait(self) -> int:
        """Block until the server exits; Ctrl-C, or SIGTERM sent to this process, stop it
        cleanly first. Returns its exit code."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            while self.process is not None and self.process.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            log.info("stopping tritonserver")
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.stop() or 0

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _kill_group(pgid: int) -> None:
    """End what is left of the server's process group (stubs of a server that was killed)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_shm(prefix: str) -> list[Path]:
    """Delete /dev/shm files of one run (a crashed python stub leaves its region behind)."""
    removed = []
    if SHM_DIR.is_dir():
        for path in SHM_DIR.glob(f"{prefix}*"):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
