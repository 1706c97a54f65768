"""`docker run` lines for the serving image (qvl_trt/deploy/container.py)."""

from __future__ import annotations

import shlex

from qvl_trt.deploy.container import container_command, container_run


def test_container_command_mounts_what_the_build_reads(tmp_path):
    out, model, profile = tmp_path / "my build", tmp_path / "ckpt", tmp_path / "p.toml"
    words = shlex.split(container_command(out, [model, profile], image="qvl-trt:1-rtx",
                                          shm_bytes=3 * 2**30 + 1))
    assert words[:4] == ["docker", "run", "--rm", "--gpus"] and "qvl-trt:1-rtx" in words
    assert "--shm-size=4g" in words  # whole GiB, rounded up
    volumes = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
    for path in (out, model, profile):
        assert f"{path}:{path}" in volumes
    assert words[words.index("qvl-trt:1-rtx") + 1:] == ["qvl-trt", "build", "--resume", str(out)]


def test_nothing_is_installed_when_the_container_starts(tmp_path):
    """A GPU node may have no package index: the image carries what the command needs."""
    line = container_run([tmp_path], "qvl-trt serve /models", image="img", shm_bytes=1,
                         ports=(8000,))
    assert "pip" not in line and "bash -c" not in line
    assert shlex.split(line)[-4:] == ["img", "qvl-trt", "serve", "/models"]
    assert "-p 8000:8000" in line
