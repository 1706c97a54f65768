"""The build's stage structure: staging + rename, manifest records, skipping, refusals."""

from __future__ import annotations

import errno
import fcntl
import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from cli_harness import HEAVY, run_cli
from typer.testing import CliRunner

from qvl_trt.atomic import leftovers
from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.build.runner import os_error_line
from qvl_trt.cli import app
from qvl_trt.errors import BuildError, ConfigError
from qvl_trt.manifest import BuildFolder
from qvl_trt.profiles import load_profile
from qvl_trt.testing.tiny_checkpoint import write_config_only
from qvl_trt.workload import Workload


def test_inspect_and_plan_build_then_skip(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    args = ["build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out), "--only", "plan"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "built inspect, plan" in first.output
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["profile"] == "4090d" and plan["problems"] == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"inspect", "plan"}
    assert manifest["stages"]["plan"]["outputs"].keys() == {"plan.json", "profile.json"}
    assert manifest["options"]["model"] == str(tiny_ckpt.resolve())

    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0 and "built nothing; skipped inspect, plan" in second.output
    # what a served repository's python stubs leave: a cache, not a changed output
    (out / "plan" / "1" / "__pycache__").mkdir(parents=True)
    (out / "plan" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    third = CliRunner().invoke(app, args)
    assert third.exit_code == 0 and "built nothing; skipped inspect, plan" in third.output
    (out / "plan" / "plan.json").write_text("{}")
    assert "built plan" in CliRunner().invoke(app, args).output


def test_a_failing_stage_leaves_nothing_half_written(tmp_path):
    model = write_config_only(tmp_path / "8b", "8b")
    out = tmp_path / "b"
    # --only plan: a whole build is refused before any stage (no weights to convert).
    result = CliRunner().invoke(app, ["build", "-m", str(model), "-g", "4060ti", "-o", str(out),
                                      "--only", "plan"])
    assert result.exit_code == 1 and "does not fit profile 4060ti" in result.output
    assert not (out / "plan").exists()
    assert leftovers(out) == []
    assert set(json.loads((out / "manifest.json").read_text())["stages"]) == {"inspect"}


def test_the_build_uses_and_records_the_limits_planned_for_its_checkpoint(tmp_path):
    model = write_config_only(tmp_path / "8b", "8b")
    out = tmp_path / "b"
    run_build(BuildOptions(str(model), "h200", workload=Workload.VIDEO), out,
              only=(Stage.PLAN,))
    # The video workload lets a request carry the clip budget (12288 tokens, the prompt grown
    # by as much); 13 slots of its table would add more than 25% to a decode step: 12.
    shipped = load_profile("h200").limits
    video = replace(shipped, max_visual_tokens_per_request=12288, video_max_tokens=12288,
                    max_input_len=20480, max_seq_len=26624, max_batch_size=12)
    profile = json.loads((out / "plan" / "profile.json").read_text())
    assert BuildFolder(out).profile().limits == video
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["workload"] == "video" and plan["limits"] == profile["limits"]
    assert plan["lowered"] == [{"key": "max_batch_size", "profile_value": 48, "value": 12}]
    assert {c["key"] for c in plan["raised"]} == {
        "max_visual_tokens_per_request", "video_max_tokens", "max_input_len", "max_seq_len"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"]["plan"]["summary"]["lowered"] == {"max_batch_size": [48, 12]}
    assert manifest["inputs"]["profile"]["limits"]["max_batch_size"] == 12
    assert manifest["options"]["workload"] == "video"
    assert manifest["cache_key"].startswith("qvl-trt-h200.video-")
    # What the LLM engine is built with follows the same limits.
    from qvl_trt.llm.engine import engine_build_config

    config = engine_build_config(BuildFolder(out).profile(), deepstack_layers=3)
    assert config["max_batch_size"] == 12 and config["max_seq_len"] == 26624
    assert config["max_prompt_embedding_table_size"] == 12 * 4 * 12288


def test_out_folder_of_another_model_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    run_build(BuildOptions(str(tiny_ckpt), "4090d"), out, only=(Stage.PLAN,))
    other = write_config_only(tmp_path / "2b", "2b")
    with pytest.raises(BuildError, match="holds a build of .* pick another --out"):
        run_build(BuildOptions(str(other), "4090d"), out, only=(Stage.PLAN,))


def test_a_held_lock_refuses_a_second_build(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    with (out / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(BuildError, match="another qvl-trt build .* is writing"):
            run_build(BuildOptions(str(tiny_ckpt), "4090d"), out, only=(Stage.PLAN,))


def test_only_is_parsed_into_stages():
    assert Stage.parse_list("vision, repo,") == (Stage.VISION, Stage.REPO)
    with pytest.raises(ConfigError, match=r"--only 'vision,bogus': stages are inspect, plan, "
                                          r"vision, llm_checkpoint, llm, repo, manifest$"):
        Stage.parse_list("vision,bogus")


def test_bad_options_are_one_line_errors(tiny_ckpt, tmp_path):
    runner = CliRunner()
    cases = [
        (["build", "-m", str(tiny_ckpt)], "build needs --model and --gpu"),
        (["build", "-m", str(tiny_ckpt), "-g", "4090d", "--only", "vision,bogus"], "--only"),
        (["build", "--resume", str(tmp_path)], "holds no build manifest"),
        (["build", "--resume", str(tmp_path), "-g", "4090d"], "--resume takes its options"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output


def test_build_folder_names_each_stage_output_once(tmp_path):
    from qvl_trt.manifest import BuildFolder

    folder = BuildFolder(tmp_path)
    assert folder.profile_file == tmp_path / "plan" / "profile.json"
    assert folder.vision_engine == tmp_path / "vision" / "model.engine"
    assert folder.llm_engine_config == tmp_path / "llm" / "engine" / "config.json"
    with pytest.raises(BuildError, match=r"is not a qvl-trt build folder \(no manifest.json\)"):
        folder.manifest()
    with pytest.raises(BuildError, match=r"has no plan/profile.json; run `qvl-trt build "):
        folder.profile()
    with pytest.raises(BuildError, match=r"has no llm/engine/, which holds it; finish the build"):
        folder.finished(folder.llm_engine, "holds it")
    folder.profile_file.parent.mkdir()
    folder.profile_file.write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match=r"profile.json: missing key"):
        folder.profile()
def test_vision_dtype_refusal_comes_before_any_stage(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    result = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out),
                     "--vision-dtype", "float32", block=HEAVY)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: --vision-dtype float32: the engine takes float16 "
                                     "or bfloat16")
    assert not out.exists()
    # Typer refuses names that are no dtype, listing them (a usage error).
    bad = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "--vision-dtype", "fp16",
                  block=HEAVY)
    text = " ".join(bad.stderr.replace("│", " ").split())
    assert bad.returncode == 2 and "'fp16' is not one of 'float16', 'bfloat16', 'float32'" in text


# ---- faults: every failure is one `error:` line, nothing half-written -----------------------

@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(name, size, read_only=False) -> a real tmpfs of `size` at tmp_path/name
    (root only: a 0555 folder does not stop root, a read-only mount does); unmounted after."""
    mounted = []

    def mount(name: str, size: str, read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def _one_error_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in (done.stderr + done.stdout).splitlines()
              if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_a_full_disk_is_one_error_line_and_leaves_no_staging(tiny_ckpt, mount_tmpfs):
    # 2 MiB holds inspect/ and plan/, not the converted language model (~14 MB).
    out = mount_tmpfs("small", "2m") / "b"
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out),
                   "--only", "llm_checkpoint")
    line = _one_error_line(done, "No space left on device", "free space there or pass --out")
    assert str(out) in line
    assert leftovers(out) == [] and not (out / "llm_checkpoint").exists()
    assert set(json.loads((out / "manifest.json").read_text())["stages"]) == {"inspect", "plan"}


def test_a_read_only_out_is_one_error_line(tiny_ckpt, mount_tmpfs):
    read_only = mount_tmpfs("ro", "1m", read_only=True)
    for out in (read_only, read_only / "b"):  # an existing folder, and one to create
        done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out),
                       "--only", "plan")
        _one_error_line(done, "Read-only file system", "pass a writable --out")


def test_an_out_that_is_a_file_is_one_error_line(tiny_ckpt, tmp_path):
    file = tmp_path / "taken"
    file.write_text("not a folder")
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(file), "--only", "plan")
    _one_error_line(done, f"--out {file} is a file, not a folder")
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(file / "b"),
                   "--only", "plan")
    _one_error_line(done, "Not a directory", "a file is in the way")
    assert file.read_text() == "not a folder"


def test_an_os_error_names_path_cause_and_fix():
    line = os_error_line(OSError(errno.ENOSPC, "No space left on device", "/x/rank0"), Path("/x"))
    assert line == ("build into /x failed: /x/rank0: No space left on device (errno 28); free "
                    "space there or pass --out on a larger filesystem")


def _refused_before_any_stage(out: Path, done: subprocess.CompletedProcess, *needles: str):
    _one_error_line(done, *needles)
    # Refused by the checks, before inspect (the first stage) ran: no stage folder, no record.
    assert not [p for p in out.iterdir() if p.is_dir()]
    assert not (out / "manifest.json").exists()


def test_a_missing_tokenizer_is_refused_before_any_stage(tiny_ckpt, tmp_path):
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_ckpt, model)
    (model / "tokenizer.json").unlink()
    out = tmp_path / "b"
    done = run_cli("build", "-m", str(model), "-g", "4090d", "-o", str(out))
    _refused_before_any_stage(out, done, "has no tokenizer.json", "preprocessing")
    # Only the repo stage reads it: a build without it is not refused.
    assert run_cli("build", "-m", str(model), "-g", "4090d", "-o", str(out), "--only",
                   "plan").returncode == 0


def test_an_impossible_tp_size_is_refused_before_any_stage(tiny_ckpt, tmp_path):
    out = tmp_path / "b"
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out),
                   "--tp-size", "3")
    _refused_before_any_stage(out, done, "tensor-parallel size 3 does not divide")


def test_weight_only_int4_with_a_tp_size_the_features_do_not_fill_is_refused(tiny_ckpt,
                                                                          tmp_path):
    out = tmp_path / "b"
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out),
                   "--weights", "int4", "--tp-size", "2")
    _refused_before_any_stage(out, done, "--weights int4 needs the model's hidden size (64) "
                              "to be a multiple of 128 (64 x TP size 2)")


def test_the_weights_option_is_in_the_record_and_the_cache_key(tiny_ckpt, tmp_path):
    """`--weights` reaches the manifest's options, reproduce.sh and the cache key."""
    keys = {}
    for weights in ("none", "int8"):
        out = tmp_path / weights
        run_build(BuildOptions(str(tiny_ckpt), "4090d", weights=weights), out,
                  only=(Stage.MANIFEST,))
        manifest = json.loads((out / "manifest.json").read_text())
        script = (out / "manifest" / "reproduce.sh").read_text()
        keys[weights] = manifest["cache_key"]
        if weights == "none":  # the default leaves the record as it was before the option
            assert "weights" not in manifest["options"] and "--weights" not in script
        else:
            assert manifest["options"]["weights"] == weights and "--weights int8" in script
    assert keys["none"] != keys["int8"]
    with pytest.raises(ConfigError, match="--weights int2: one of none, int8, int4"):
        BuildOptions(str(tiny_ckpt), "4090d", weights="int2")


def test_without_tensorrt_llm_the_build_still_writes_the_reference_repository(tiny_ckpt,
                                                                               tmp_path):
    """Exit 3 at the LLM engine, and the reference repository (which needs no engine) is
    written, validated and named with the line that serves it; asked without the repo stage,
    the build writes none."""
    from qvl_trt.triton.validate import validate_repo

    out = tmp_path / "b"
    args = ("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out))
    result = run_cli(*args, "--only", "llm", block=("tensorrt_llm",))
    assert result.returncode == 3, result.stderr
    assert not (out / "repo").exists() and "Meanwhile" not in result.stderr

    result = run_cli(*args, "--only", "llm,repo", block=("tensorrt_llm",))
    assert result.returncode == 3, result.stderr
    repo = out / "repo" / "reference"
    assert validate_repo(repo).ok
    message = " ".join(result.stderr.split())
    assert "stage llm: " in message and "TensorRT-LLM 1.2 container" in message
    assert f"serve it with `qvl-trt serve {repo} --openai-port 9000`" in message
    assert sorted(p.name for p in (out / "repo").iterdir()) == ["reference"]
