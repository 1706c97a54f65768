"""Shared fixtures. Nothing here may reach a model hub: tests build what they need."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set before any test imports huggingface_hub, which reads these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The pixel kernels compile once per test run, into a folder of the run's own rather than the
# user's numba cache, and every process of the run (tritonservers' preprocessing instances
# included) loads them (qvl_trt/mm/kernel_cache.py); a NUMBA_CACHE_DIR already set is kept.
# Set before numba is imported, which reads it then.
if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="qvl-trt-numba-")
    atexit.register(shutil.rmtree, os.environ["NUMBA_CACHE_DIR"], ignore_errors=True)

# One torch (and OpenMP) thread per process: every model here is tiny, so an op takes
# microseconds and a second thread only adds the wait for it to be scheduled, which on a busy
# machine (the test process, a server's stubs and other work share the cores) costs
# milliseconds per op: the tiny decoder made tokens several times slower with two threads
# than with one. Set before torch is imported; tritonservers' stubs inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from qvl_trt.testing.small_profile import small_profile_toml  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-VL checkpoint (default TinyDims, seed 0, tied, float32, one
    safetensors file), built once per session. Treat it as read-only."""
    from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_ckpt: Path):
    """transformers' Qwen3VLForConditionalGeneration of the tiny checkpoint (fp32, eval), loaded
    once per session. Read-only: do not change its weights or move it to another device."""
    import torch
    import transformers

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        str(tiny_ckpt), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_vision_onnx(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path):
    """(dtype, edition="tensorrt_rtx") -> the tiny checkpoint's vision tower exported to ONNX
    (qvl_trt.vision.export.VisionOnnx), each exported once per session. Read-only."""
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.profiles import TrtEdition
    from qvl_trt.vision.export import export_vision_onnx

    root = tmp_path_factory.mktemp("vision_onnx")
    exports = {}

    def get(dtype: str, edition: TrtEdition = TrtEdition.TENSORRT_RTX):
        key = (dtype, TrtEdition(edition))
        if key not in exports:
            exports[key] = export_vision_onnx(open_checkpoint(tiny_ckpt),
                                              root / f"{dtype}-{key[1].value}", dtype=dtype,
                                              edition=key[1])
        return exports[key]

    return get


# ---- Triton repository and server (tests/test_triton_*.py) ---------------------------------

# A GPU profile with small limits, so requests on the tiny checkpoint stay cheap on a CPU:
# images become 4..64 visual tokens, the MRoPE table 1024 positions.


@pytest.fixture(scope="session")
def triton_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small-limits GPU profile file of the Triton tests."""
    path = tmp_path_factory.mktemp("profile") / "tiny-test.toml"
    path.write_text(small_profile_toml())
    return path


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path,
               triton_profile: Path) -> Path:
    """A build folder of the tiny checkpoint for `triton_profile` with its converted LLM
    checkpoint (`qvl-trt build --only llm_checkpoint`): what the reference repository needs.
    Read-only; `tiny_vision_build` adds the vision engine to the same folder."""
    from qvl_trt.build import BuildOptions, Stage, run_build

    out = tmp_path_factory.mktemp("triton_build") / "tiny"
    run_build(BuildOptions(model=str(tiny_ckpt), gpu=str(triton_profile)), out,
              only=(Stage.LLM_CHECKPOINT,))
    return out


@pytest.fixture(scope="session")
def tiny_vision_build(tiny_build: Path) -> Path:
    """`tiny_build` plus its TensorRT-RTX vision engine (built without a GPU). Read-only."""
    from qvl_trt.build import Stage, resume_build

    resume_build(tiny_build, only=(Stage.VISION,))
    return tiny_build


@pytest.fixture(scope="session")
def trt_repo(tmp_path_factory: pytest.TempPathFactory, tiny_vision_build: Path) -> Path:
    """The trt repository of `tiny_vision_build` (a GeForce profile: TensorRT-RTX vision
    engine) around a placeholder LLM engine laid out as TensorRT-LLM writes it. Read-only."""
    from qvl_trt.testing.trt_layout import trt_repo_of

    return trt_repo_of(tiny_vision_build, tmp_path_factory.mktemp("trt_repo"))


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory, tiny_build: Path):
    """A real tritonserver (the nvidia-pytriton build) serving the reference-flavor
    repository of `tiny_build` on free ports, for the whole session. At the end it is stopped
    and the test checks that nothing is left: no process, no /dev/shm region."""
    from qvl_trt.machine import find_tritonserver
    from qvl_trt.serve.server import SHM_DIR, ServerOptions, TritonServer, free_ports
    from qvl_trt.testing.processes import group_gone_within
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                        "'qvl-trt[serve]'")
    if find_tritonserver() is None:
        pytest.skip("needs a tritonserver: pip install 'qvl-trt[serve]' (nvidia-pytriton)")
    root = tmp_path_factory.mktemp("triton_server")
    repo = write_repo([BuildInput(tiny_build)], root / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  vision_cache_mib=64))
    server = TritonServer(ServerOptions(repo.path, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=180)
    server.start()
    pid = server.process.pid
    yield server
    server.stop()
    # the server's whole process group is gone (a killed stub takes a moment under load)
    assert group_gone_within(pid), "tritonserver or a stub outlived the server's stop"
    assert not list(SHM_DIR.glob(f"{server.opts.shm_prefix}*")), "shared memory left behind"


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory, triton_server):
    """The OpenAI-compatible gateway (`qvl-trt gateway`, a child process) in front of
    `triton_server`, for the whole session. At the end SIGTERM must stop it with exit code 0."""
    pytest.importorskip("aiohttp", reason="the gateway needs aiohttp: pip install "
                        "'qvl-trt[gateway]'")
    pytest.importorskip("prometheus_client", reason="the gateway needs prometheus-client: pip "
                        "install 'qvl-trt[gateway]'")
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = GatewayProcess(GatewayOptions(triton_server.grpc_url, port=free_ports().http),
                             log_file=log)
    process.start()
    process.wait_ready()
    yield process
    assert process.stop() == 0, log.read_text()
