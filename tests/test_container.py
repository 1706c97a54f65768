"""`docker run` lines for the TensorRT-LLM container (qvl_trt/container.py)."""

from __future__ import annotations

import shlex

from qvl_trt.container import TRTLLM_CONTAINER, container_command


def test_container_command_mounts_what_the_build_reads(tmp_path):
    out, model, profile = tmp_path / "my build", tmp_path / "ckpt", tmp_path / "p.toml"
    words = shlex.split(container_command(out, [model, profile], shm_bytes=3 * 2**30 + 1))
    assert words[:4] == ["docker", "run", "--rm", "--gpus"] and TRTLLM_CONTAINER in words
    assert "--shm-size=4g" in words  # whole GiB, rounded up
    volumes = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
    for path in (out, model, profile):
        assert f"{path}:{path}" in volumes
    assert words[-1].endswith(f"qvl-trt build --resume {shlex.quote(str(out))}")
    assert "[rtx]" not in words[-1]
    # GeForce profiles' TensorRT-RTX engines need the rtx extra in the container.
    rtx = shlex.split(container_command(out, [model], shm_bytes=1, extras=("rtx",)))
    install = rtx[-1].split(" && ")[0]
    assert install.startswith("pip install -q") and "[rtx]" in install
