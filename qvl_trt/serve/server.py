"""Starting and stopping tritonserver on a generated repository.

One rank: `tritonserver --model-repository=R ...` on the given (or free) ports with a per-run
shared-memory prefix for the python backend. Tensor-parallel engines (`world_size` N): one
rank per GPU through mpirun, as the TensorRT-LLM backend expects: rank 0 loads every model
and serves the endpoints; ranks > 0 load only the tensorrt_llm models (explicit model
control) and join rank 0 through MPI. Each rank gets its own shm prefix.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..child import kill_group, popen_owned, signals_held
from ..errors import ConfigError, DependencyError, ServerError
from ..machine import PYTRITON_STUBS, TritonInstall, find_tritonserver
from ..triton.restricted import ADMIN_HEADER, RESTRICTED_APIS, http_headers
from ..triton.runtime.admission import FOLDER_PREFIX as ADMISSION_PREFIX
from ..triton.runtime.admission import SHM_DIR, admission_root

log = logging.getLogger(__name__)

STUB_NAME = "triton_python_backend_stub"
# The python backend's `thread-pool-size` default (its README): the server's threads that run
# BLS requests; a decoupled BLS call holds one until its first response, so more concurrent
# callers than threads queue their time to first token.
DEFAULT_THREAD_POOL = 32
# Triton's shutdown log line once no model has an inference in flight (server.cc). After it
# Triton 2.51 only unloads; a client's idle gRPC stream keeps the ensemble loaded until the
# stream closes, and Triton closes its endpoints only after every model unloaded, so with
# such a client it waits out --exit-timeout-secs ("Exit timeout expired") and exits 1.
DRAINED_LINE = "Found 0 model versions that have in-flight inferences"
# How long the unloading may take after the drain before the server is ended (nothing is
# in flight any more; the python models' finalize ran or is held by such a stream).
UNLOAD_GRACE_S = 5.0
# Triton's own --exit-timeout-secs is set this much past serve's drain budget and the unload
# grace: serve decides when the server ends, so Triton's timer never fires first (it would
# exit 1, "Exit timeout expired", while an idle client stream holds a model loaded).
EXIT_MARGIN_S = 10.0
# How long a start may take until the server answers ready (the engines load meanwhile).
STARTUP_TIMEOUT_S = 300.0


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
    # After SIGTERM, how long the requests in flight get to finish (the drain); a drain that
    # outlasts it is cut (the server killed, exit code 1).
    drain_timeout_s: float = 10.0
    log_verbose: int = 0
    # Explicit model control with only these models loaded at start (None: load the whole
    # repository); models are then loaded one by one through the repository API.
    explicit_models: tuple[str, ...] | None = None
    # Where the HTTP and gRPC endpoints listen (None: `host`, as the metrics one does): a pod
    # keeps them on the loopback interface behind its authenticating gateway.
    inference_host: str | None = None
    # The value of ADMIN_HEADER that RESTRICTED_APIS (triton/restricted.py) ask for, None: not
    # restricted. serve draws one for each run (new_admin_key), which only it and its gateway
    # know; logged masked.
    admin_key: str | None = field(default=None, repr=False)

    @property
    def endpoint_host(self) -> str:
        return self.host if self.inference_host is None else self.inference_host

    def port_hosts(self) -> dict[str, tuple[int, str]]:
        """Each endpoint's port and listening address."""
        return {"http": (self.ports.http, self.endpoint_host),
                "grpc": (self.ports.grpc, self.endpoint_host),
                "metrics": (self.ports.metrics, self.host)}


def new_admin_key() -> str:
    return secrets.token_urlsafe(24)


def new_shm_prefix() -> str:
    """A prefix no other run uses, so this run's /dev/shm regions can be found and removed."""
    return f"qvl{os.getpid()}x{secrets.token_hex(3)}_"


def is_ipv6(host: str) -> bool:
    return ":" in host


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def host_port(host: str, port: int) -> str:
    """`host:port` as URLs and gRPC targets write it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def triton_address(host: str, endpoint: str) -> str:
    """A listening address as tritonserver takes it. Its HTTP and metrics servers (libevhtp)
    read an IPv6 address only after an `ipv6:` prefix, and then listen on IPv6 alone; its
    gRPC server joins address and port with a colon, so an IPv6 one needs brackets (both
    seen with Triton 2.51: a bare `::` gave 255.255.255.255 and ':::8001' respectively)."""
    if not is_ipv6(host):
        return host
    return f"[{host}]" if endpoint == "grpc" else f"ipv6:{host}"


def free_ports(host: str = "127.0.0.1") -> Ports:
    """Three ports free right now on `host` (bound together, then released)."""
    socks = []
    try:
        for _ in range(3):
            s = socket.socket(family(host), socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return Ports(*(s.getsockname()[1] for s in socks))
    finally:
        for s in socks:
            s.close()


def check_ports_free(opts: ServerOptions) -> None:
    """A ServerError naming a port another process listens on (a start tried again may find
    it free: a restart right after a kill). Without it the new server
    fails to bind and exits, while the one already there answers the readiness poll on that
    port, so the start looked ready. SO_REUSEADDR as the servers bind: only a listening
    socket makes it fail, not the connections a server just killed left in TIME_WAIT."""
    for name, (port, host) in opts.port_hosts().items():
        with socket.socket(family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ServerError(f"the {name} port {port} on {host} is taken "
                                  f"({exc.strerror}): another server runs there; stop it, or "
                                  f"pick another with --{name}-port or --free-ports") from None


def client_host(listen: str) -> str:
    """Where a client on this machine reaches a server listening on `listen`: a server on
    every interface through the loopback one."""
    if listen in ("0.0.0.0", ""):
        return "127.0.0.1"
    return "::1" if listen == "::" else listen


def local_address(listen: str, port: int) -> str:
    """`host:port` where a client on this machine reaches a server listening on `listen`."""
    return host_port(client_host(listen), port)


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
    source = install.binary.parent.parent / PYTRITON_STUBS / version / STUB_NAME
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
        *(f"--{name}-{flag}={value}" for name, (port, host) in opts.port_hosts().items()
          for flag, value in (("port", port), ("address", triton_address(host, name)))),
        f"--exit-timeout-secs={triton_exit_timeout_s(opts)}",
        *(f"--{flag}={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={opts.admin_key}"
          for flag in ("http-restricted-api", "grpc-restricted-protocol")
          if opts.admin_key is not None),
    ]
    if install.origin == "pytriton":
        cmd += [f"--backend-directory={install.backends}", "--allow-gpu-metrics=false"]
    if opts.log_verbose:
        cmd.append(f"--log-verbose={opts.log_verbose}")
    if rank > 0:
        # Ranks > 0 only run the TensorRT-LLM workers that rank 0's backend drives over MPI.
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={name}" for name in opts.llm_models]
    elif opts.explicit_models is not None:
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={name}" for name in opts.explicit_models]
    return cmd


def triton_exit_timeout_s(opts: ServerOptions) -> int:
    return math.ceil(opts.drain_timeout_s + UNLOAD_GRACE_S + EXIT_MARGIN_S)


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
    """The command as a shell line (with the PATH it needs), for --dry-run and logs; the
    admin key shown as KEY."""
    prefix = "".join(f"{key}={shlex.quote(entry)}:${key} "
                     for key, entry in env_prepends(install).items())
    shown = [arg.split(f":{ADMIN_HEADER}=")[0] + f":{ADMIN_HEADER}=KEY"
             if f":{ADMIN_HEADER}=" in arg else arg for arg in cmd]
    return prefix + shlex.join(shown)


class TritonServer:
    """A running tritonserver. Use as a context manager, or call start() and stop()."""

    def __init__(self, opts: ServerOptions, *, install: TritonInstall | None = None,
                 log_file: Path | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.opts = opts
        self.install = install or require_tritonserver()
        self.log_file = log_file
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._log_handle = None

    @property
    def http_url(self) -> str:
        return local_address(self.opts.endpoint_host, self.opts.ports.http)

    @property
    def grpc_url(self) -> str:
        return local_address(self.opts.endpoint_host, self.opts.ports.grpc)

    @property
    def metrics_url(self) -> str:
        return f"http://{local_address(self.opts.host, self.opts.ports.metrics)}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """What an HTTP request to RESTRICTED_APIS carries."""
        return http_headers(self.opts.admin_key)

    def start(self) -> TritonServer:
        check_ports_free(self.opts)
        prepare_tritonserver(self.install)
        cmd = server_command(self.install, self.opts)
        log.info("starting: %s", format_command(cmd, self.install))
        remove_stale_shm()
        if self.log_file is not None and self._log_handle is None:
            self._log_handle = open(self.log_file, "ab")  # noqa: SIM115 (closed in stop)
        self.drained = threading.Event()
        # Own session: a terminal's Ctrl-C reaches only us, and stop() can end the whole
        # group (the python backend stubs are the server's children; they exit by
        # themselves within a few seconds of the server's death). The log comes through a
        # pipe so stop() sees the drain finish.
        try:
            with signals_held():  # a stop signal now is delivered once stop() can end it
                self.process = popen_owned(
                    cmd, env=server_env(self.install), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                self._pump = threading.Thread(target=self._copy_log,
                                              args=(self.process.stdout,),
                                              name="tritonserver-log", daemon=True)
                self._pump.start()
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

    def _copy_log(self, pipe) -> None:
        sink = self._log_handle or sys.stderr.buffer
        for line in pipe:
            if DRAINED_LINE.encode() in line:
                self.drained.set()
            sink.write(line)
            sink.flush()
        pipe.close()

    def stubs(self) -> dict[str, int]:
        """The python backend stubs now running under the server: model instance name (e.g.
        `preprocessing_0_0`) -> pid. A stub's command line ends with its instance name and
        the runtime, see python_backend src/stub_launcher.cc."""
        found = {}
        if self.process is None:
            return found
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            # a zombie (state Z) is a stub that died and is not yet reaped
            if int(fields[1]) == self.process.pid and fields[0] != "Z" and \
                    argv[0].endswith(STUB_NAME.encode()) and len(argv) > 3:
                found[argv[-3].decode()] = int(entry.name)
        return found

    def _log_tail(self, lines: int = 30) -> str:
        if self.log_file is None or not Path(self.log_file).is_file():
            return ""
        tail = Path(self.log_file).read_text(errors="replace").splitlines()[-lines:]
        return "; its log ends:\n" + "\n".join(tail)

    def stop(self, *, force: bool = False) -> int | None:
        """SIGTERM: Triton refuses new requests and finishes those in flight, then unloads.
        Once drained it gets UNLOAD_GRACE_S to exit before its group is ended (see
        DRAINED_LINE; that stop counts as clean: 0); a drain that outlasts
        `drain_timeout_s` is cut (1). SIGKILL at once with `force` (or a second signal, see
        kill()). Then this run's shared-memory files are removed. Returns the exit code."""
        code = None
        if self.process is not None:
            try:
                if self.process.poll() is None and not force:
                    self.process.send_signal(signal.SIGTERM)
                    code = self._wait_drained()
            finally:  # also when a second Ctrl-C interrupts the drain
                kill_group(self.process.pid)
                waited = self.process.wait()
                self._pump.join(timeout=5)
                self.process = None
            code = (1 if waited < 0 else waited) if code is None else code
        self.close_log()
        remove_shm(self.opts.shm_prefix)
        remove_stale_shm()  # this server's admission folders among them, now it is gone
        return code

    def _wait_drained(self) -> int | None:
        """Wait for the server to drain after SIGTERM: its own exit code if it exits, 0 when it
        is ended after a finished drain, 1 when the drain is cut, None when it was killed
        meanwhile (kill())."""
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while time.monotonic() < deadline:
            try:
                code = self.process.wait(timeout=0.2)
                return None if code < 0 else code
            except subprocess.TimeoutExpired:
                pass
            if self.drained.is_set():
                try:
                    code = self.process.wait(timeout=UNLOAD_GRACE_S)
                    return None if code < 0 else code
                except subprocess.TimeoutExpired:
                    log.info("tritonserver drained; ending it (an idle client stream holds "
                             "a model loaded)")
                    return 0
        log.warning("tritonserver did not drain within %.0f s; cutting the requests still in "
                    "flight", self.opts.drain_timeout_s)
        return 1

    def kill(self) -> None:
        """SIGKILL the server's process group now (stop() then reaps it)."""
        if self.process is not None:
            kill_group(self.process.pid)

    def close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def remove_stale_shm() -> list[Path]:
    """Delete /dev/shm files left by runs whose process is gone (a serve killed with -9
    cannot clean up; see `new_shm_prefix` for the pid in the name), and the admission folders
    of tritonservers that are gone (triton/runtime/admission.py, named after the server)."""
    removed = []
    for path in SHM_DIR.glob("qvl*x*_*") if SHM_DIR.is_dir() else ():
        pid = path.name[3:].split("x", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    for path in admission_root().glob(f"{ADMISSION_PREFIX}*-*"):
        pid = path.name.removeprefix(ADMISSION_PREFIX).split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_shm(prefix: str) -> list[Path]:
    """Delete /dev/shm files of one run (a crashed python stub leaves its region behind)."""
    removed = []
    if SHM_DIR.is_dir():
        for path in SHM_DIR.glob(f"{prefix}*"):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
