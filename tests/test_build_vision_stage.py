"""The vision build stage and `qvl-trt export-vision`, end to end on the tiny checkpoint:
export, validation against HF, a TensorRT-RTX engine built without a GPU; a profile change
rebuilds the engine but reuses the ONNX; full TensorRT stops the stage before exporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import run_cli
from test_child import assert_gone_and_quiet, wait_until

from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.deps import available
from qvl_trt.errors import StageUnavailable
from qvl_trt.hashing import FileHasher
from qvl_trt.manifest import Manifest

pytestmark = pytest.mark.skipif(
    not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
    reason="needs TensorRT-RTX: pip install 'qvl-trt[rtx]'")


@pytest.fixture(scope="module")
def vision_build(tmp_path_factory, tiny_ckpt) -> Path:
    """`qvl-trt build --only vision` for the 4090d profile (TensorRT-RTX, SM 8.9)."""
    out = tmp_path_factory.mktemp("build") / "4090d"
    done = run_cli("build", "--model", str(tiny_ckpt), "--gpu", "4090d", "--out", str(out),
                   "--only", "vision")
    assert done.returncode == 0, done.stderr
    assert "built inspect, plan, vision" in done.stdout
    # The validation lines are part of the stage's log.
    assert "validation vs Hugging Face" in done.stderr and "PASS" in done.stderr
    return out


def test_stage_writes_engine_onnx_and_build_files(vision_build: Path) -> None:
    vision = vision_build / "vision"
    names = {str(p.relative_to(vision)) for p in vision.rglob("*") if p.is_file()}
    assert names == {"model.engine", "config.json", "build_config.json", "build.log",
                     "reproduce.sh", "onnx/model.onnx", "onnx/model.onnx.data",
                     "onnx/onnx.json", "onnx/validation.txt", "export_config.json",
                     "export.log", "reproduce_export.sh"}
    # The export and its validation ran in a child process, whose log this is.
    assert "exported" in (vision / "export.log").read_text()
    config = json.loads((vision / "config.json").read_text())
    assert config["edition"] == "tensorrt_rtx" and config["compute_capabilities"] == ["8.9"]
    assert config["dtype"] == "float16"
    validation = (vision / "onnx" / "validation.txt").read_text().splitlines()
    assert len(validation) == 4 and all(line.split()[-5] == "PASS" for line in validation)
    record = Manifest.load(vision_build).stages["vision"]
    assert record["summary"]["onnx"] == "exported"
    assert record["outputs"]["model.engine"] == FileHasher().hash(vision / "model.engine")


def test_unchanged_stage_is_skipped(vision_build: Path, tiny_ckpt) -> None:
    result = run_build(BuildOptions(model=str(tiny_ckpt), gpu="4090d"), vision_build,
                       only=(Stage.VISION,))
    assert {r.stage: r.status for r in result.stages}[Stage.VISION] == "skipped"


def test_profile_change_rebuilds_the_engine_but_reuses_the_onnx(tmp_path, vision_build: Path,
                                                                 tiny_ckpt) -> None:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(vision_build, out)
    onnx = out / "vision" / "onnx" / "model.onnx.data"
    inode = onnx.stat().st_ino
    result = run_build(BuildOptions(model=str(tiny_ckpt), gpu="3090"), out,
                       only=(Stage.VISION,))
    vision = {r.stage: r for r in result.stages}[Stage.VISION]
    assert vision.status == "built" and vision.summary["onnx"] == "reused"
    assert vision.summary["compute_capabilities"] == ["8.6"]
    assert onnx.stat().st_ino == inode  # linked, not exported again
    config = json.loads((out / "vision" / "config.json").read_text())
    assert config["compute_capabilities"] == ["8.6"]


def test_reuse_needs_equal_inputs_and_intact_files(vision_build: Path, tmp_path) -> None:
    from qvl_trt.build.vision_stage import _reuse_export
    from qvl_trt.vision.export import read_export_meta

    onnx = vision_build / "vision" / "onnx"
    inputs = read_export_meta(onnx)["inputs"]
    recorded = Manifest.load(vision_build).stages["vision"]["outputs"]
    hasher = FileHasher()
    assert not _reuse_export(onnx, tmp_path / "a", {**inputs, "dtype": "bfloat16"}, recorded,
                             hasher)
    assert not _reuse_export(onnx, tmp_path / "e", {**inputs, "opset": 18}, recorded, hasher)
    tampered = {**recorded, "onnx/model.onnx.data": "0" * 64}
    assert not _reuse_export(onnx, tmp_path / "b", inputs, tampered, hasher)
    assert _reuse_export(onnx, tmp_path / "c", inputs, recorded, hasher)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(
        p.name for p in onnx.iterdir())


@pytest.mark.skipif(available("tensorrt"), reason="full TensorRT is installed here")
def test_full_tensorrt_profile_stops_before_exporting(tmp_path, tiny_ckpt) -> None:
    with pytest.raises(StageUnavailable, match="needs full TensorRT.*docker run"):
        run_build(BuildOptions(model=str(tiny_ckpt), gpu="h100"), tmp_path / "h100",
                  only=(Stage.VISION,))
    assert not (tmp_path / "h100" / "vision").exists()


def test_export_vision_command(tmp_path, tiny_ckpt) -> None:
    out = tmp_path / "onnx32"
    done = run_cli("export-vision", "--model", str(tiny_ckpt), "--dtype", "float32",
                   "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "max|diff|" in line]
    assert [line.split()[0] for line in lines] == ["image_embeds", "deepstack_0", "deepstack_1",
                                                   "deepstack_2"]
    assert all("PASS" in line and "<= 1e-05" in line for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx.data",
                                                     "onnx.json", "validation.txt"]
    bad = run_cli("export-vision", "--model", str(tiny_ckpt), "--dtype", "int8",
                  "--out", str(tmp_path / "x"))
    # A usage error of the enum-typed option, naming the choices.
    text = " ".join(bad.stderr.replace("│", " ").split())
    assert bad.returncode == 2 and "'int8' is not one of 'float16', 'bfloat16', 'float32'" in text


def test_failed_engine_build_keeps_its_folder(tmp_path, tiny_ckpt) -> None:
    """A real build failure (TensorRT-RTX cannot compile bf16 for Turing): the stage fails
    with the builder's reason, and the files its message names are kept."""
    from qvl_trt.errors import BuildError
    from qvl_trt.profiles import resolve_profile_path

    profile = tmp_path / "turing.toml"
    profile.write_text(resolve_profile_path("4090d").read_text().replace(
        'compute_capability = "8.9"', 'compute_capability = "7.5"'))
    out = tmp_path / "out"
    with pytest.raises(BuildError) as info:
        run_build(BuildOptions(model=str(tiny_ckpt), gpu=str(profile),
                               vision_dtype="bfloat16"), out, only=(Stage.VISION,))
    message = str(info.value)
    assert "sm75" in message and "b16" in message
    failed = out / "vision.failed"
    assert f"bash {failed / 'reproduce.sh'}" in message
    assert (failed / "reproduce.sh").is_file() and (failed / "onnx" / "model.onnx").is_file()
    assert "sm75" in (failed / "build.log").read_text()
    assert not (out / "vision").exists()


@pytest.mark.parametrize(("gpu", "cc"), [("4060ti", "8.9"), ("5090", "12.0")])
def test_new_geforce_profiles_build_here(tmp_path, vision_build: Path, tiny_ckpt, gpu,
                                         cc) -> None:
    """`qvl-trt build --gpu 4060ti|5090 --only vision`: TensorRT-RTX builds for the card's
    compute capability with no GPU (SM120 is in TensorRT-RTX 1.7's ComputeCapability)."""
    import shutil

    out = tmp_path / gpu
    shutil.copytree(vision_build, out)  # the ONNX is reused; only the engine is built
    done = run_cli("build", "--model", str(tiny_ckpt), "--gpu", gpu, "--out", str(out),
                   "--only", "vision")
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "vision" / "config.json").read_text())
    assert config["edition"] == "tensorrt_rtx" and config["compute_capabilities"] == [cc]
    assert Manifest.load(out).stages["vision"]["summary"]["onnx"] == "reused"


# `qvl-trt build` whose export or engine child (the module argv[1] names) is a ticker (pid,
# then a tick every 20 ms into its folder, the staging folder): the real runner, stage and
# run_child around it.
_SLOW_CHILD_BUILD = """
import sys
import qvl_trt.child as child
from test_child import _TICKER
slow = sys.argv.pop(1)
real = child.run_child
child.run_child = lambda cmd, **kw: real(
    [sys.executable, "-c", _TICKER] if slow in cmd else cmd, **kw)
sys.argv = ["qvl-trt", *sys.argv[1:]]
from qvl_trt.cli import main
main()
"""


@pytest.mark.parametrize("child", ["qvl_trt.vision.validate", "qvl_trt.vision.engine"],
                         ids=["export", "engine"])
def test_kill_9_of_a_build_leaves_no_child(tmp_path, tiny_ckpt, child) -> None:
    out = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    build = subprocess.Popen([sys.executable, "-c", _SLOW_CHILD_BUILD, child, "build", "-m",
                              str(tiny_ckpt), "-g", "4090d", "-o", str(out), "--only", "vision"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: any(out.glob(".vision.partial-*/ticks")), 240), \
            f"the {child} child never started"
    finally:
        build.kill()
        build.wait(timeout=30)
    staging = next(out.glob(".vision.partial-*"))
    assert_gone_and_quiet(int((staging / "pid").read_text()), staging / "ticks")
    # The next build removes what the killed one left.
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out), "--only", "plan")
    assert done.returncode == 0 and not list(out.glob(".vision.partial-*"))


def test_two_builds_of_the_same_inputs_give_the_same_bytes(vision_build: Path, tiny_ckpt,
                                                           tmp_path) -> None:
    """Another folder, the same checkpoint and profile: every output the manifest does not
    mark as varying (with TensorRT-RTX: the logs, the export's config naming the checkpoint's
    path, and the engine) has the same sha256."""
    other = tmp_path / "elsewhere"
    assert run_cli("build", "--model", str(tiny_ckpt), "--gpu", "4090d", "--out", str(other),
                   "--only", "vision").returncode == 0
    for stage in ("inspect", "plan", "vision"):
        first = Manifest.load(vision_build).stages[stage]
        second = Manifest.load(other).stages[stage]
        assert first["varies"] == second["varies"]
        same = {k: v for k, v in first["outputs"].items() if k not in first["varies"]}
        assert same == {k: v for k, v in second["outputs"].items() if k not in first["varies"]}
    vision = Manifest.load(other).stages["vision"]
    assert list(vision["varies"]) == ["build.log", "export.log", "export_config.json",
                                      "model.engine"]
    assert {"config.json", "onnx/model.onnx", "onnx/onnx.json"} <= vision["outputs"].keys()
