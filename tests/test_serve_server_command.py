"""tritonserver command lines (qvl_trt/serve/server.py), without starting a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from qvl_trt.errors import ConfigError, ServerError
from qvl_trt.machine import TritonInstall
from qvl_trt.serve.server import (
    Ports,
    ServerOptions,
    check_ports_free,
    format_command,
    free_ports,
    server_command,
)

INSTALL = TritonInstall(Path("/opt/tritonserver/bin/tritonserver"),
                        Path("/opt/tritonserver/backends"), "ngc", "2.71.0")


def test_tensor_parallel_launch_is_one_rank_per_gpu_through_mpirun() -> None:
    opts = ServerOptions(Path("/models"), Ports(9000, 9001, 9002), world_size=2,
                         llm_models=("a_tensorrt_llm", "b_tensorrt_llm"), shm_prefix="run7_")
    cmd = server_command(INSTALL, opts)
    assert cmd[0] == "mpirun" and cmd.count(":") == 1
    rank0, rank1 = " ".join(cmd).split(" : ")
    assert rank0.count("-n 1") == 1 and rank1.startswith("-n 1 /opt/tritonserver/bin/tritonserver")
    for rank, line in enumerate((rank0, rank1)):
        assert f"shm-region-prefix-name=run7_r{rank}_" in line
        assert "--model-repository=/models" in line and "--http-port=9000" in line
    assert "--model-control-mode=explicit" not in rank0
    assert ("--model-control-mode=explicit --load-model=a_tensorrt_llm "
            "--load-model=b_tensorrt_llm") in rank1
    assert format_command(cmd, INSTALL).startswith("mpirun ")


def test_single_rank_and_bad_world_sizes() -> None:
    opts = ServerOptions(Path("/models"), shm_prefix="p_")
    assert server_command(INSTALL, opts)[0] == "/opt/tritonserver/bin/tritonserver"
    with pytest.raises(ConfigError, match="world-size must be >= 1"):
        server_command(INSTALL, ServerOptions(Path("/m"), world_size=0))
    with pytest.raises(ConfigError, match="reference flavor"):
        server_command(INSTALL, ServerOptions(Path("/m"), world_size=2))


def test_tritons_own_exit_timer_outlasts_serves_drain_and_unload_grace() -> None:
    """serve ends the server itself (0 after a finished drain, 1 after a cut one): Triton's
    --exit-timeout-secs must never fire first, or a drain that ends near it exits 1 with
    "Exit timeout expired" while an idle client stream holds a model loaded."""
    from qvl_trt.serve.server import UNLOAD_GRACE_S

    for drain in (0.5, 10.0, 95.5):
        cmd = server_command(INSTALL, ServerOptions(Path("/m"), drain_timeout_s=drain))
        (flag,) = [a for a in cmd if a.startswith("--exit-timeout-secs=")]
        assert int(flag.split("=")[1]) >= drain + UNLOAD_GRACE_S + 5


def test_a_port_another_server_listens_on_is_refused_before_the_start() -> None:
    """Else the new server fails to bind and exits while the old one answers the readiness
    poll on that port: the start would look ready."""
    import socket

    ports = free_ports()
    opts = ServerOptions(Path("/models"), ports)
    check_ports_free(opts)
    with socket.socket() as other:
        other.bind(("127.0.0.1", ports.grpc))
        other.listen()
        with pytest.raises(ServerError, match=rf"the grpc port {ports.grpc} on 127.0.0.1 is "
                           "taken .*pick another with --grpc-port or --free-ports"):
            check_ports_free(opts)
