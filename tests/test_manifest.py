"""Build manifest: inputs, tools, outputs and timings; stage skipping; the lock;
reproduce.sh. Runs the real `qvl-trt build` in child processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_harness import run_cli

from qvl_trt.atomic import leftovers
from qvl_trt.build import Stage, checkpoint_hashes, run_build
from qvl_trt.dtypes import Dtype, WeightOnly
from qvl_trt.errors import ConfigError
from qvl_trt.hashing import FileHasher
from qvl_trt.manifest import MANIFEST_NAME, BuildOptions, Manifest
from qvl_trt.profiles import TrtEdition
from qvl_trt.workload import Workload

# Stages this machine builds for the tiny checkpoint: everything but the LLM engine, which
# needs TensorRT-LLM and a GPU (`llm` stops with exit code 3 here).
STAGES_HERE = "vision,llm_checkpoint,repo,manifest"
ALL_HERE = ["inspect", "plan", "vision", "llm_checkpoint", "repo", "manifest"]


def _build(ckpt: Path, gpu: str, out: Path, only: str = "manifest") -> dict[str, str]:
    """Run `qvl-trt build` in a child process; stage -> "built" | "skipped"."""
    result = run_cli("build", "-m", str(ckpt), "-g", gpu, "-o", str(out), "--only", only)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    built, skipped = line.split(": built ", 1)[1].split(" -> ")[0].split("; skipped ")
    status = {s: "built" for s in built.split(", ") if s != "nothing"}
    status.update({s: "skipped" for s in skipped.split(", ") if s != "nothing"})
    return status


@pytest.fixture
def report_line(capsys):
    """Print a measured number past pytest's capture (numbers are reported, not asserted)."""

    def write(line: str) -> None:
        with capsys.disabled():
            print(line)

    return write


@pytest.fixture(scope="module")
def built(tiny_ckpt, tiny_vision_build, triton_profile, tmp_path_factory) -> Path:
    """A build of every stage that runs here: a copy of the shared `tiny_vision_build` (small
    limits profile `triton_profile`) completed by the manifest stage. Tests copy it before
    changing anything."""
    out = tmp_path_factory.mktemp("built") / "b"
    shutil.copytree(tiny_vision_build, out, symlinks=True)
    status = _build(tiny_ckpt, str(triton_profile), out, STAGES_HERE)
    assert status == {**dict.fromkeys(ALL_HERE, "skipped"), "repo": "built",
                      "manifest": "built"}
    return out


def _copy_build(built: Path, dest: Path) -> Path:
    shutil.copytree(built, dest / "b", symlinks=True)
    return dest / "b"


def _touched_profile(profile: Path, folder: Path) -> Path:
    """The profile with a smaller max_batch_size (an LLM limit), under the same file name
    (so the same profile name) in `folder`."""
    text = profile.read_text()
    assert "max_batch_size = 8" in text
    touched = folder / profile.name
    touched.parent.mkdir(exist_ok=True)
    touched.write_text(text.replace("max_batch_size = 8", "max_batch_size = 4"))
    return touched


def test_unchanged_inputs_skip_every_stage(tiny_ckpt, built, triton_profile, tmp_path,
                                           report_line):
    out = _copy_build(built, tmp_path)
    started = time.perf_counter()
    again = _build(tiny_ckpt, str(triton_profile), out, STAGES_HERE)
    seconds = time.perf_counter() - started
    assert again == dict.fromkeys(ALL_HERE, "skipped")
    report_line(f"\nsecond `qvl-trt build` with nothing changed: every stage skipped, "
                f"{seconds:.2f} s for the whole command (target < 2 s)")


def test_touching_the_profile_reruns_only_dependent_stages(tiny_ckpt, built, triton_profile,
                                                           tmp_path):
    out = _copy_build(built, tmp_path)
    profile = _touched_profile(triton_profile, tmp_path / "touched")
    again = _build(tiny_ckpt, str(profile), out, STAGES_HERE)
    # An LLM limit: the plan and the repository are redone (and the LLM engine where it can
    # be built), the vision engine and the converted checkpoint kept.
    assert again == {"inspect": "skipped", "plan": "built", "vision": "skipped",
                     "llm_checkpoint": "skipped", "repo": "built", "manifest": "built"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["profile"]["limits"]["max_batch_size"] == 4


def test_which_stages_a_profile_limit_reaches(tiny_ckpt, built, triton_profile, tmp_path):
    """Stage by stage, for the LLM engine too, which is not built here: the limit is in the
    inputs of plan and llm; the repository reads the re-planned profile.json."""
    import copy

    from qvl_trt.build import BuildContext, BuildOptions
    from qvl_trt.build.stages import SPECS
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.hashing import fingerprint
    from qvl_trt.manifest import Manifest
    from qvl_trt.profiles import load_profile

    touched = _touched_profile(triton_profile, tmp_path)
    manifest = Manifest.load(built)
    replanned = copy.deepcopy(manifest)
    replanned.stages["plan"]["outputs"]["profile.json"] = "0" * 64  # plan rebuilt: new limits

    def fingerprints(profile: Path, manifest: Manifest) -> dict[str, str]:
        ctx = BuildContext(BuildOptions(str(tiny_ckpt), str(profile)), built,
                           open_checkpoint(tiny_ckpt), load_profile(str(profile)), manifest,
                           FileHasher(dict(manifest.file_hashes)))
        return {s.stage.value: fingerprint(s.inputs(ctx)) for s in SPECS
                if s.stage is not Stage.MANIFEST}

    def changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
        return {name for name in a if a[name] != b[name]}

    before = fingerprints(triton_profile, manifest)
    direct = changed(before, fingerprints(touched, manifest))
    through_plan = changed(before, fingerprints(triton_profile, replanned))
    assert direct == {"plan", "llm"}
    assert through_plan == {"repo"}


def test_a_changed_output_file_is_rebuilt(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    _build(tiny_ckpt, "4090d", out)
    (out / "plan" / "plan.json").write_text("{}")
    assert _build(tiny_ckpt, "4090d", out)["plan"] == "built"
    assert json.loads((out / "plan" / "plan.json").read_text())["profile"] == "4090d"


def test_manifest_records_inputs_tools_outputs_and_timings(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    run_build(BuildOptions(str(tiny_ckpt), "4090d"), out, only=(Stage.MANIFEST,))
    m = json.loads((out / "manifest.json").read_text())
    assert m["inputs"]["checkpoint"] == checkpoint_hashes_of(tiny_ckpt)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(m["inputs"]["checkpoint"])
    assert m["inputs"]["profile"]["name"] == "4090d" and "source" not in m["inputs"]["profile"]
    assert str(tiny_ckpt) not in json.dumps(m["inputs"])  # no machine paths in the key
    assert m["cache_key"].startswith("qvl-trt-4090d-")
    assert {"qvl_trt", "tensorrt", "tensorrt_rtx", "tensorrt_llm", "cuda", "driver",
            "gpus"} <= set(m["tools"])
    assert m["tools"]["tensorrt_rtx"]  # installed here
    for name in ("inspect", "plan", "manifest"):
        record = m["stages"][name]
        assert record["seconds"] >= 0 and record["tools"]["qvl_trt"] == m["qvl_trt"]
        for rel, digest in record["outputs"].items():
            assert FileHasher().hash(out / name / rel) == digest
    assert set(m["stages"]["manifest"]["summary"]["seconds"]) == {"inspect", "plan"}


def checkpoint_hashes_of(ckpt: Path) -> dict[str, str]:
    from qvl_trt.checkpoint import open_checkpoint

    return checkpoint_hashes(open_checkpoint(ckpt), FileHasher())


def test_reproduce_script_checks_the_checkpoint_and_rebuilds(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    run_build(BuildOptions(str(tiny_ckpt), "4090d"), out, only=(Stage.MANIFEST,))
    script = out / "manifest" / "reproduce.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OUT": str(tmp_path / "again")}
    rebuilt = subprocess.run(["bash", str(script), "--only", "plan"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert ((tmp_path / "again" / "plan" / "plan.json").read_text()
            == (out / "plan" / "plan.json").read_text())

    # A checkpoint that differs in one file is refused before anything is built.
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_ckpt.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    env.update(MODEL=str(other), OUT=str(tmp_path / "refused"))
    refused = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "config.json: FAILED" in refused.stdout + refused.stderr
    assert not (tmp_path / "refused").exists()


def test_lock_refuses_a_second_build_process(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from qvl_trt.build import build_lock\n"
         "with build_lock(Path(sys.argv[1])):\n"
         "    print('locked', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out))
        assert refused.returncode == 1
        assert f"another qvl-trt build (pid {holder.pid}) is writing" in refused.stderr
        assert not (out / "manifest.json").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert _build(tiny_ckpt, "4090d", out)["plan"] == "built"


def test_leftovers_of_a_killed_build_are_removed(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    (out / ".vision.partial-99999").mkdir(parents=True)
    (out / ".vision.partial-99999" / "half.onnx").write_bytes(b"\0")
    (out / ".plan.old-99999").mkdir()
    run_build(BuildOptions(str(tiny_ckpt), "4090d"), out, only=(Stage.PLAN,))
    assert leftovers(out) == []


def test_varying_outputs_name_what_a_rebuild_may_change():
    from qvl_trt.manifest import Stage, varying_outputs
    from qvl_trt.profiles import TrtEdition

    outputs = {name: "0" * 64 for name in ("model.engine", "timing.cache", "build.log",
                                           "config.json", "onnx/model.onnx")}
    rtx = varying_outputs(Stage.VISION, outputs, TrtEdition.TENSORRT_RTX)
    assert list(rtx) == ["build.log", "model.engine"]
    full = varying_outputs(Stage.VISION, outputs, TrtEdition.TENSORRT)
    assert list(full) == ["build.log", "model.engine", "timing.cache"]
    assert "timing" in full["model.engine"]
    assert varying_outputs(Stage.INSPECT, {"inspect.json": "0" * 64}, TrtEdition.TENSORRT) == {}
    repo = {"trt/tensorrt_llm/config.pbtxt": "", "trt/ensemble/1/build.json": ""}
    assert list(varying_outputs(Stage.REPO, repo, TrtEdition.TENSORRT)) == [
        "trt/tensorrt_llm/config.pbtxt"]


# ---- the options, typed through the manifest --------------------------------------------------

def test_the_options_round_trip_typed_through_the_manifest(tmp_path):
    options = BuildOptions("ckpt", "h200", TrtEdition.TENSORRT, "bfloat16", 2, "int8", "video")
    Manifest(options=options).save(tmp_path)
    loaded = Manifest.load(tmp_path).options
    assert loaded == options
    # Members, not their strings (which compare equal to them).
    assert loaded.trt_edition is TrtEdition.TENSORRT and loaded.vision_dtype is Dtype.BFLOAT16
    assert loaded.weights is WeightOnly.INT8 and loaded.workload is Workload.VIDEO
    assert loaded.tp_size == 2


# A manifest as qvl-trt wrote it before the options were typed, and before --weights and
# --workload: a plain table without those keys, and the llm_dtype of earlier versions.
_EARLIER = {"schema_version": 1, "qvl_trt": "0.1.0",
            "options": {"model": "/ckpt", "gpu": "4090d", "trt_edition": None,
                        "vision_dtype": "float16", "tp_size": 1, "llm_dtype": "float16"},
            "inputs": {}, "cache_key": "qvl-trt-4090d-0", "tools": {}, "stages": {},
            "file_hashes": {}}


def test_a_manifest_of_an_earlier_version_reads_with_the_defaults(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(_EARLIER))
    manifest = Manifest.load(tmp_path)
    assert manifest.options == BuildOptions("/ckpt", "4090d")
    assert manifest.options.weights is WeightOnly.NONE
    assert manifest.options.workload is Workload.CHAT
    # Written again, the options keep their keys (less llm_dtype): the build's cache key, which
    # hashes them, stays.
    manifest.save(tmp_path)
    saved = json.loads((tmp_path / MANIFEST_NAME).read_text())["options"]
    assert saved == {k: v for k, v in _EARLIER["options"].items() if k != "llm_dtype"}


@pytest.mark.parametrize(("options", "error"), [
    ({"llm_dtype": "bfloat16"}, "^the build's manifest.json sets llm_dtype 'bfloat16', but "
                                "qvl-trt builds the language model in float16 only; remove the key"),
    ({"vision_dtype": "float32"}, "^--vision-dtype float32: the engine takes float16 or bfloat16$"),
    ({"quantize": "fp8"}, "^manifest.json options: unknown key 'quantize'; allowed keys: "),
    ({"tp_size": "2"}, r"^manifest.json options.tp_size: expected an integer, got '2'$"),
])
def test_options_no_version_wrote_are_one_line_errors(tmp_path, options, error):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(
        {**_EARLIER, "options": {**_EARLIER["options"], **options}}))
    with pytest.raises(ConfigError, match=error):
        Manifest.load(tmp_path)
