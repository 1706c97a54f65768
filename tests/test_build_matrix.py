"""`qvl-trt matrix` against its JSON schema, its cache keys against real builds, and the
worked GitHub Actions example against the matrix fields."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from cli_harness import HEAVY, run_cli

from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.build.matrix import ci_matrix
from qvl_trt.deploy.container import TRTLLM_CONTAINER
from qvl_trt.profiles import profile_names
from qvl_trt.testing.tiny_checkpoint import write_config_only

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "matrix.schema.json").read_text())
WORKFLOW = ROOT / ".github" / "workflows" / "engines.yml"


@pytest.fixture(scope="module")
def full_matrix(tiny_ckpt) -> dict:
    result = run_cli("matrix", "--model", str(tiny_ckpt), "--gpus", "all", block=HEAVY)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_matrix_validates_against_the_schema(full_matrix):
    jsonschema.validate(full_matrix, SCHEMA)
    jobs = full_matrix["include"]
    assert [j["gpu"] for j in jobs] == profile_names()
    for job in jobs:
        assert f"gpu-sm{job['compute_capability'].replace('.', '')}" in job["runner"]
        assert job["container"] == TRTLLM_CONTAINER
        assert job["cache_key"].startswith(job["cache_prefix"])
        assert ("rtx" in job["extras"].split(",")) == (job["trt_edition"] == "tensorrt_rtx")
    assert len({j["cache_key"] for j in jobs}) == len(jobs)
    by_gpu = {j["gpu"]: j for j in jobs}
    assert {g: (by_gpu[g]["runner"][-1], by_gpu[g]["trt_edition"])
            for g in ("4060ti", "5090", "h20", "l20")} == {
        "4060ti": ("gpu-sm89", "tensorrt_rtx"), "5090": ("gpu-sm120", "tensorrt_rtx"),
        "h20": ("gpu-sm90", "tensorrt"), "l20": ("gpu-sm89", "tensorrt")}


def test_the_schema_rejects_a_broken_matrix(full_matrix):
    for path, value in ((("runner",), ["self-hosted"]), (("cache_key",), "qvl-trt-x-short"),
                        (("trt_edition",), "tensorrt_llm"), (("extra_field",), 1)):
        broken = copy.deepcopy(full_matrix)
        broken["include"][0][path[0]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


def test_cache_key_equals_the_manifest_of_a_real_build(tiny_ckpt, tmp_path):
    (job,) = ci_matrix(tiny_ckpt, "a10g")["include"]
    out = tmp_path / "a10g"
    run_build(BuildOptions(str(tiny_ckpt), "a10g"), out, only=(Stage.PLAN,))
    assert json.loads((out / "manifest.json").read_text())["cache_key"] == job["cache_key"]
    # Another profile's limits give another key; the same checkpoint elsewhere the same one.
    assert ci_matrix(tiny_ckpt, "l4")["include"][0]["cache_key"] != job["cache_key"]
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in tiny_ckpt.iterdir():
        (moved / f.name).symlink_to(f)
    assert ci_matrix(moved, "a10g")["include"][0]["cache_key"] == job["cache_key"]


def test_cache_key_follows_the_limits_planned_for_the_checkpoint(tmp_path):
    # The 8B on an A10G builds with a lower max_batch_size than the profile's: the matrix
    # derives the same limits, hence the same key, without building.
    model = write_config_only(tmp_path / "8b", "8b")
    (job,) = ci_matrix(model, "a10g")["include"]
    out = tmp_path / "a10g"
    run_build(BuildOptions(str(model), "a10g"), out, only=(Stage.PLAN,))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["profile"]["limits"]["max_batch_size"] == 3
    assert manifest["cache_key"] == job["cache_key"]


def test_unknown_gpu_is_a_one_line_error(tiny_ckpt):
    result = run_cli("matrix", "--model", str(tiny_ckpt), "--gpus", "4090d,nosuchgpu")
    assert result.returncode == 1 and "unknown GPU profile 'nosuchgpu'" in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_workflow_uses_only_fields_the_matrix_has():
    text = WORKFLOW.read_text()
    workflow = yaml.safe_load(text)
    jobs = workflow["jobs"]
    assert "qvl-trt matrix" in " ".join(s.get("run", "") for s in jobs["matrix"]["steps"])
    used = set(re.findall(r"\$\{\{\s*matrix\.(\w+)", text))
    assert used <= set(SCHEMA["$defs"]["job"]["properties"]), used
    assert {"runner", "container", "cache_key", "cache_prefix", "build_dir"} <= used
    for name in ("prepare", "engines"):
        assert "fromJSON(needs.matrix.outputs.matrix)" in jobs[name]["strategy"]["matrix"]
    engines = " ".join(s.get("run", "") for s in jobs["engines"]["steps"])
    assert "qvl-trt build --resume" in engines
    saves = [s for s in jobs["engines"]["steps"] if s.get("uses", "").startswith(
        "actions/cache/save")]
    assert saves and saves[0]["with"]["key"] == "${{ matrix.cache_key }}"
