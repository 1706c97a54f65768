"""`serve()`: a written repository served until SIGTERM or Ctrl-C: tritonserver under the
supervisor (restarts, readiness) and, with an OpenAI port, the gateway beside it. `qvl-trt
serve` is this call; `prepare()` alone is its --dry-run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..gateway.options import AnswerCacheOptions, GatewayOptions
from ..gateway.readiness import READY_PATH
from ..machine import TritonInstall
from .gateway_process import GatewayProcess
from .load_time import record_load_time
from .needs import (
    ServeNeeds,
    check_vision_editions,
    point_engine_paths,
    read_needs,
    resolve_world_size,
    shm_size_bytes,
    warn_small_shm,
)
from .options import ServeOptions
from .server import (
    ServerOptions,
    TritonServer,
    client_host,
    format_command,
    free_ports,
    local_address,
    new_admin_key,
    require_tritonserver,
    server_command,
)
from .supervisor import Supervisor

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Serving:
    """What `serve` runs, resolved from the repository and the options."""

    needs: ServeNeeds
    install: TritonInstall
    server: ServerOptions
    health_port: int | None  # the user's, or a loopback one the gateway forwards
    health_host: str
    gateway: GatewayOptions | None

    @property
    def command(self) -> str:
        """The tritonserver command line, as a shell would run it."""
        return format_command(server_command(self.install, self.server), self.install)


def prepare(repo: Path, opts: ServeOptions) -> Serving:
    """Read what serving `repo` needs and resolve the ports and processes; starts nothing."""
    if not repo.is_dir():
        raise ConfigError(f"{repo} is not a folder; pass a model repository written by "
                          "`qvl-trt repo`")
    needs = read_needs(repo)
    install = require_tritonserver()
    ports = free_ports(client_host(opts.host)) if opts.pick_free_ports else opts.ports
    server = ServerOptions(repo, ports, host=opts.host, inference_host=opts.inference_host,
                           world_size=resolve_world_size(needs, opts.world_size),
                           llm_models=needs.llm_models, thread_pool_size=needs.thread_pool_size,
                           log_verbose=opts.log_verbose, drain_timeout_s=opts.drain_timeout_s,
                           admin_key=new_admin_key())
    health_port, health_host, gateway = opts.health_port, opts.host, None
    if opts.openai_port is not None:
        if health_port is None:  # the gateway forwards serve's readiness from a private port
            health_port, health_host = free_ports(LOOPBACK).http, LOOPBACK
        gateway = GatewayOptions(
            local_address(server.endpoint_host, ports.grpc), host=opts.openai_host or opts.host,
            port=opts.openai_port, api_key=opts.api_key, keys_file=opts.keys_file,
            triton_admin_key=server.admin_key,
            # Its answers in flight get the drain serve gives Triton's (docs/deployment.md).
            shutdown_timeout_s=opts.drain_timeout_s,
            ready_url=f"http://{local_address(health_host, health_port)}{READY_PATH}",
            answer_cache=AnswerCacheOptions(enabled=opts.answer_cache))
    return Serving(needs, install, server, health_port, health_host, gateway)


def serve(repo: Path, opts: ServeOptions, *,
          on_ready: Callable[[TritonServer, GatewayProcess | None], None] | None = None) -> int:
    """Serve `repo` until SIGTERM or Ctrl-C (a second one forces it); `on_ready` is called
    once the server (and the gateway) first answer. Returns the server's exit code."""
    serving = prepare(repo, opts)
    check_vision_editions(serving.needs)
    warn_small_shm(serving.needs, shm_size_bytes())
    point_engine_paths(serving.needs)
    server = TritonServer(serving.server, install=serving.install, log_file=opts.log_file)
    gateway = GatewayProcess(serving.gateway) if serving.gateway is not None else None

    def ready() -> None:
        if gateway is not None:
            gateway.wait_ready()
        if on_ready is not None:
            on_ready(server, gateway)

    supervisor = Supervisor(server, serving.needs.ensembles, health_port=serving.health_port,
                            health_host=serving.health_host, rules=opts.liveness,
                            warm=opts.warm_up, on_ready=ready,
                            on_loaded=lambda seconds: record_load_time(serving.needs.repo, seconds),
                            companions=(gateway,) if gateway is not None else ())
    return supervisor.run() or 0
