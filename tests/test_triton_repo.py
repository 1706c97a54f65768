"""`qvl-trt repo`, `validate` and `serve --dry-run`, and the build's repo stage, on the tiny
build: repositories are self-contained and valid; broken ones fail with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import run_cli

from qvl_trt.atomic import leftovers
from qvl_trt.build import Stage, resume_build
from qvl_trt.deps import available
from qvl_trt.errors import ConfigError
from qvl_trt.triton.configs import Flavor
from qvl_trt.triton.pbconfig import CONFIG_FILE, data_type, parse_config, read_config, to_text
from qvl_trt.triton.repository import (
    RUNTIME_ZIP,
    BuildInput,
    RepoOptions,
    point_engine_paths,
    write_repo,
)
from qvl_trt.triton.validate import validate_repo

pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'qvl-trt[serve]'")

needs_rtx = pytest.mark.skipif(
    not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
    reason="the trt flavor needs the tiny vision engine, built with TensorRT-RTX: "
    "pip install 'qvl-trt[rtx]'")


def linked_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def problems(repo: Path) -> list[str]:
    return [str(p) for p in validate_repo(repo).problems]


def edit_config(model_dir: Path, edit) -> None:
    config = read_config(model_dir)
    edit(config)
    (model_dir / CONFIG_FILE).write_text(to_text(config))


# ---- reference flavor -----------------------------------------------------------------------

def test_reference_repository_is_valid_and_self_contained(tmp_path, tiny_build) -> None:
    result = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                        RepoOptions(flavor=Flavor.REFERENCE))
    repo = result.path
    assert sorted(p.name for p in repo.iterdir()) == sorted(result.models) == [
        "ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls",
        "vision_encoder"]
    assert problems(repo) == []
    for path in repo.glob(f"*/{CONFIG_FILE}"):
        text = path.read_text()
        assert str(tiny_build) not in text, f"{path} points into the build folder"
        parse_config(text, str(path))
    # Each python model imports qvl_trt from the zip beside it, not an installed qvl-trt.
    zips = sorted(repo.glob(f"*/1/{RUNTIME_ZIP}"))
    assert len(zips) == 5 and len({z.read_bytes() for z in zips}) == 1
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import qvl_trt.triton.postprocess, "
             "qvl_trt; print(qvl_trt.__file__)")
    done = subprocess.run([sys.executable, "-c", probe, str(zips[0])], capture_output=True,
                          text=True, cwd=tmp_path, check=True)
    assert done.stdout.strip().startswith(str(zips[0]))


@pytest.mark.parametrize("breakage, reason", [
    ("step missing", "tensorrt_llm_bls: calls nowhere, which is not in the repository"),
    ("llm input retyped", "tensorrt_llm_bls -> tensorrt_llm: mrope_position_deltas: dtype INT64 "
                          "is produced, INT32 expected"),
])
def test_tensorrt_llm_bls_calls_are_validated(tmp_path, tiny_build, breakage, reason) -> None:
    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path

    def retype(config) -> None:
        next(i for i in config.input
             if i.name == "mrope_position_deltas").data_type = data_type("INT32")

    if breakage == "step missing":
        edit_config(repo / "tensorrt_llm_bls", lambda cfg: cfg.parameters[
            "preprocessing_model"].__setattr__("string_value", "nowhere"))
    else:
        edit_config(repo / "tensorrt_llm", retype)
    found = problems(repo)
    assert any(reason in p for p in found), found


def test_several_builds_get_their_own_model_names(tmp_path, tiny_build) -> None:
    result = write_repo([BuildInput(tiny_build, "small"), BuildInput(tiny_build, "big")],
                        tmp_path / "repo", RepoOptions(flavor=Flavor.REFERENCE))
    assert {b.names.ensemble for b in result.builds} == {"small", "big"}
    assert problems(result.path) == []
    post = read_config(result.path / "big_postprocessing")
    assert post.parameters["tensorrt_llm_model"].string_value == "big_tensorrt_llm"
    steps = [s.model_name for s in read_config(result.path / "big").ensemble_scheduling.step]
    assert steps == ["big_preprocessing", "big_vision_encoder", "big_postprocessing"]
    with pytest.raises(ConfigError, match="two builds are named 'x'"):
        write_repo([BuildInput(tiny_build, "x"), BuildInput(tiny_build, "x")],
                   tmp_path / "dup", RepoOptions(flavor=Flavor.REFERENCE))
    assert not (tmp_path / "dup").exists()
    assert leftovers(tmp_path) == [], "a failed write leaves nothing behind"


def test_repo_command_and_build_stage(tmp_path, tiny_build) -> None:
    out = tmp_path / "repo"
    done = run_cli("repo", "--build", str(tiny_build), "--out", str(out), "--flavor",
                   "reference")
    assert done.returncode == 0, done.stderr
    assert "wrote the reference repository" in done.stdout
    again = run_cli("repo", "--build", str(tiny_build), "--out", str(out))
    assert again.returncode == 1 and "pass --force" in again.stderr
    checked = run_cli("validate", str(out))
    assert checked.returncode == 0 and "valid" in checked.stdout
    # The build stage writes the flavors its stages allow: reference (no LLM engine here).
    build = linked_copy(tiny_build, tmp_path / "build")
    resume_build(build, only=(Stage.REPO,))
    assert sorted(p.name for p in (build / "repo").iterdir()) == ["reference"]
    assert problems(build / "repo" / "reference") == []


# ---- trt flavor -----------------------------------------------------------------------------

def write_llm_engine_layout(build: Path) -> None:
    """An LLM engine folder laid out as TensorRT-LLM 1.2's `engine.save` writes it: config.json
    (pretrained_config: the converted checkpoint's config; build_config: what the llm stage
    builds with) and one rank file per TP rank. TensorRT-LLM does not install here; validate
    reads only these files, never the engine bytes, so the rank file holds a marker."""
    from qvl_trt.llm.engine import engine_build_config
    from qvl_trt.profiles import load_profile

    manifest = json.loads((build / "manifest.json").read_text())
    pretrained = json.loads((build / "llm_checkpoint" / "config.json").read_text())
    settings = engine_build_config(load_profile(manifest["options"]["gpu"]),
                                   deepstack_layers=pretrained["num_deepstack_layers"])
    engine = build / "llm" / "engine"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps(
        {"version": "1.2.1", "pretrained_config": pretrained, "build_config": settings}))
    (engine / "rank0.engine").write_bytes(b"TensorRT-LLM engine placeholder (not loadable)")


@pytest.fixture(scope="module")
def trt_repo(tmp_path_factory, tiny_vision_build) -> Path:
    root = tmp_path_factory.mktemp("trt_repo")
    build = linked_copy(tiny_vision_build, root / "build")
    write_llm_engine_layout(build)
    return write_repo([BuildInput(build)], root / "repo").path


@needs_rtx
def test_trt_repository_passes_validate(trt_repo) -> None:
    report = validate_repo(trt_repo)
    assert report.ok, report.problems
    done = run_cli("validate", str(trt_repo))
    assert done.returncode == 0 and "valid" in done.stdout
    llm = read_config(trt_repo / "tensorrt_llm")
    assert llm.backend == "tensorrtllm"
    assert llm.parameters["gpt_model_path"].string_value == str(
        trt_repo / "tensorrt_llm" / "1" / "engine")


@needs_rtx
@pytest.mark.parametrize("breakage, reason", [
    ("map dtype", "_pixel_values -> pixel_values: dtype FP32 is produced, FP16 expected"),
    ("llm engine", "LLM engine rank0.engine is missing"),
    ("vision engine", "vision engine engine/model.engine (+ config.json) is missing"),
    ("edition", "vision engine was built with tensorrt, the repository's profile"),
    ("placeholder", "holds an unfilled ${...} placeholder"),
    ("stray folder", "no config.pbtxt: Triton loads every folder"),
])
def test_broken_repository_fails_validate_with_the_reason(tmp_path, trt_repo, breakage,
                                                          reason) -> None:
    repo = Path(shutil.copytree(trt_repo, tmp_path / "repo"))

    def retype(config) -> None:
        next(i for i in config.input if i.name == "pixel_values").data_type = data_type("FP16")

    if breakage == "map dtype":
        edit_config(repo / "vision_encoder", retype)
    elif breakage == "llm engine":
        (repo / "tensorrt_llm" / "1" / "engine" / "rank0.engine").unlink()
    elif breakage == "vision engine":
        (repo / "vision_encoder" / "1" / "engine" / "model.engine").unlink()
    elif breakage == "edition":
        path = repo / "vision_encoder" / "1" / "engine" / "config.json"
        path.write_text(path.read_text().replace('"tensorrt_rtx"', '"tensorrt"'))
    elif breakage == "placeholder":
        edit_config(repo / "tensorrt_llm", lambda cfg: cfg.parameters[
            "gpt_model_path"].__setattr__("string_value", "${engine_dir}"))
    else:
        (repo / ".cache").mkdir()
    found = problems(repo)
    assert any(reason in p for p in found), found
    done = run_cli("validate", str(repo))
    assert done.returncode == 1 and "problem" in done.stdout


@needs_rtx
def test_moved_repository_gets_its_engine_path_back(tmp_path, trt_repo) -> None:
    moved = Path(shutil.copytree(trt_repo, tmp_path / "elsewhere"))
    assert point_engine_paths(moved) == ["tensorrt_llm"]
    path = read_config(moved / "tensorrt_llm").parameters["gpt_model_path"].string_value
    assert path == str(moved.resolve() / "tensorrt_llm" / "1" / "engine")
    assert point_engine_paths(moved) == []
    assert problems(moved) == []


@needs_rtx
def test_serve_dry_run_prints_one_rank_per_gpu(trt_repo) -> None:
    done = run_cli("serve", str(trt_repo), "--world-size", "2", "--dry-run")
    assert done.returncode == 0, done.stderr
    line = " ".join(done.stdout.split())
    assert "mpirun" in line and line.count(" -n 1 ") == 2
    assert "--model-control-mode=explicit --load-model=tensorrt_llm" in line
    prefixes = sorted(set(part.split("=")[-1] for part in line.split()
                          if "shm-region-prefix-name" in part))
    assert len(prefixes) == 2 and prefixes[0].endswith("r0_") and prefixes[1].endswith("r1_")
