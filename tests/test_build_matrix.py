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

from qvl_trt.build import BuildOptions, Stage, resume_build, run_build
from qvl_trt.build.matrix import ci_matrix
from qvl_trt.deploy.container import TRTLLM_CONTAINER
from qvl_trt.dtypes import WeightOnly
from qvl_trt.errors import ConfigError, PlanError
from qvl_trt.profiles import profile_names
from qvl_trt.testing.small_profile import small_profile_toml
from qvl_trt.testing.tiny_checkpoint import write_config_only

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "matrix.schema.json").read_text())
WORKFLOW = ROOT / ".github" / "workflows" / "engines.yml"


ALL_WEIGHTS = tuple(WeightOnly)


@pytest.fixture(scope="module")
def full_matrix(tiny_ckpt) -> dict:
    result = run_cli("matrix", "--model", str(tiny_ckpt), "--gpus", "all", "--weights",
                     "none,int8,int4", block=HEAVY)
    assert result.returncode == 0 and not result.stderr, result.stderr  # all fit: no notes
    return json.loads(result.stdout)


def _prefix_restores_another_job(jobs: list[dict]) -> list[tuple[str, str]]:
    """(prefix, key) where a job's restore prefix matches another job's cache key: that job
    would restore a build of another profile or precision and rebuild its engines."""
    return [(j["cache_prefix"], k["cache_key"]) for j in jobs for k in jobs
            if j is not k and k["cache_key"].startswith(j["cache_prefix"])]


def test_matrix_validates_against_the_schema(full_matrix):
    jsonschema.validate(full_matrix, SCHEMA)
    jobs = full_matrix["include"]
    assert [(j["gpu"], j["weights"]) for j in jobs] == [
        (g, w.value) for g in profile_names() for w in ALL_WEIGHTS]
    # fp16 keeps the folder and key prefix of builds made before the option; each precision
    # gets its own of both.
    for job in jobs:
        name = job["gpu"] + ("" if job["weights"] == "none" else f".{job['weights']}")
        assert job["build_dir"] == f"build/{name}"
        assert job["cache_prefix"] == f"qvl-trt-{name}-"
    assert len({j["build_dir"] for j in jobs}) == len(jobs)
    assert _prefix_restores_another_job(jobs) == []
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


def test_restore_prefixes_joined_by_a_dash_would_restore_other_precisions(full_matrix):
    # The rule above, broken on purpose: with `4090d-int8` the fp16 job's prefix
    # `qvl-trt-4090d-` matches the INT8 job's key.
    dashed = [{k: v.replace(".", "-") if k.startswith("cache") else v for k, v in j.items()}
              for j in full_matrix["include"]]
    assert ("qvl-trt-4090d-", next(j["cache_key"] for j in dashed if j["gpu"] == "4090d"
                                   and j["weights"] == "int8")) in \
        _prefix_restores_another_job(dashed)


def test_the_schema_rejects_a_broken_matrix(full_matrix):
    assert SCHEMA["$defs"]["job"]["properties"]["weights"]["enum"] == [
        w.value for w in WeightOnly]
    for path, value in ((("runner",), ["self-hosted"]), (("cache_key",), "qvl-trt-x-short"),
                        (("trt_edition",), "tensorrt_llm"), (("extra_field",), 1),
                        (("weights",), "fp8")):
        broken = copy.deepcopy(full_matrix)
        broken["include"][0][path[0]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


def test_cache_key_equals_the_manifest_of_a_real_build(tiny_ckpt, tmp_path):
    (job,) = ci_matrix(tiny_ckpt, "a10g").to_json()["include"]
    assert (job["weights"], job["build_dir"]) == ("none", "build/a10g")  # the default
    out = tmp_path / "a10g"
    run_build(BuildOptions(str(tiny_ckpt), "a10g"), out, only=(Stage.PLAN,))
    assert json.loads((out / "manifest.json").read_text())["cache_key"] == job["cache_key"]
    # Another profile's limits give another key; the same checkpoint elsewhere the same one.
    assert ci_matrix(tiny_ckpt, "l4").jobs[0].cache_key != job["cache_key"]
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in tiny_ckpt.iterdir():
        (moved / f.name).symlink_to(f)
    assert ci_matrix(moved, "a10g").jobs[0].cache_key == job["cache_key"]


def test_a_quantized_job_is_what_a_build_with_its_options_makes(tiny_ckpt, tmp_path):
    """The INT8 job's key is the manifest's of `build --weights int8` into its build_dir, which
    converts the checkpoint to W8A16; resuming it as another precision is refused."""
    jobs = ci_matrix(tiny_ckpt, "a10g", (WeightOnly.NONE, WeightOnly.INT8),
                     build_root=str(tmp_path)).jobs
    fp16, int8 = jobs
    assert int8.build_dir == f"{tmp_path}/a10g.int8" and int8.cache_key != fp16.cache_key
    run_build(BuildOptions(str(tiny_ckpt), "a10g", weights=int8.weights),
              Path(int8.build_dir), only=(Stage.LLM_CHECKPOINT,))
    out = Path(int8.build_dir)
    assert json.loads((out / "manifest.json").read_text())["cache_key"] == int8.cache_key
    converted = json.loads((out / "llm_checkpoint" / "config.json").read_text())
    assert converted["quantization"]["quant_algo"] == "W8A16"
    with pytest.raises(ConfigError, match=r"holds a build with --weights int8, not none; drop"):
        resume_build(out, only=(Stage.PLAN,), weights=WeightOnly.NONE)
    resume_build(out, only=(Stage.PLAN,), weights=WeightOnly.INT8)


def test_a_build_without_out_writes_into_the_jobs_build_dir(tiny_ckpt, tmp_path):
    (job,) = ci_matrix(tiny_ckpt, "a10g", (WeightOnly.INT4,)).jobs
    done = run_cli("build", "-m", str(tiny_ckpt), "-g", "a10g", "--weights", "int4", "--only",
                   "manifest", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / job.build_dir / "manifest.json").read_text())
    assert manifest["cache_key"] == job.cache_key


def test_cache_key_follows_the_limits_planned_for_the_checkpoint(tmp_path):
    # The 8B on an A10G builds with a lower max_batch_size than the profile's, and with INT8
    # weights on a 4060 Ti with a shorter context: the matrix derives the same limits, hence
    # the same key, without building.
    model = write_config_only(tmp_path / "8b", "8b")
    for gpu, weights, limit, value in (("a10g", WeightOnly.NONE, "max_batch_size", 3),
                                       ("4060ti", WeightOnly.INT8, "max_seq_len", 4096)):
        (job,) = ci_matrix(model, gpu, (weights,)).jobs
        out = tmp_path / gpu
        run_build(BuildOptions(str(model), gpu, weights=weights), out, only=(Stage.PLAN,))
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["inputs"]["profile"]["limits"][limit] == value
        assert manifest["cache_key"] == job.cache_key


def test_pairs_the_planner_does_not_fit_are_left_out_with_the_reason(tmp_path):
    """The 8B's fp16 weights exceed a 16 GB card: that pair is left out, noted on stderr with
    the planner's fix, and the card's quantized jobs stay; a matrix left with no job is a
    one-line error."""
    model = write_config_only(tmp_path / "8b", "8b")
    done = run_cli("matrix", "--model", str(model), "--gpus", "4060ti,a10g", "--weights",
                   "none,int8")
    assert done.returncode == 0, done.stderr
    assert [(j["gpu"], j["weights"]) for j in json.loads(done.stdout)["include"]] == [
        ("4060ti", "int8"), ("a10g", "none"), ("a10g", "int8")]
    (note,) = done.stderr.strip().splitlines()
    assert note.startswith("left out of the matrix: 4060ti with --weights none: 8b checkpoint "
                           "does not fit profile 4060ti: weights and buffers need")
    assert "build with --weights int8 or int4" in note
    done = run_cli("matrix", "--model", str(model), "--gpus", "4060ti")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: the matrix has no job, no (GPU, weights, workload) asked "
                           "for fits: 4060ti with --weights none: 8b checkpoint does not fit")
    small_card = tmp_path / "small-card.toml"
    small_card.write_text(small_profile_toml().replace("memory_mib = 24564", "memory_mib = 8192"))
    with pytest.raises(PlanError, match=r"\(and 1 more\): 4060ti with --weights none: "
                       "8b checkpoint does not fit profile 4060ti"):
        ci_matrix(model, f"4060ti,{small_card}", (WeightOnly.NONE,))


def test_a_profile_named_twice_is_a_one_line_error(tiny_ckpt):
    # Two jobs would build into one folder under one key.
    with pytest.raises(ConfigError, match="--gpus 4090d,h100,4090d: 4090d given more than "
                       "once; name each profile once"):
        ci_matrix(tiny_ckpt, "4090d,h100,4090d")


def test_unknown_gpu_is_a_one_line_error(tiny_ckpt):
    result = run_cli("matrix", "--model", str(tiny_ckpt), "--gpus", "4090d,nosuchgpu")
    assert result.returncode == 1 and "unknown GPU profile 'nosuchgpu'" in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("weights, message", [
    ("fp8", "--weights fp8: one of none, int8, int4"),  # as `build --weights fp8` says
    (" , ", "--weights ' , ' names no choice; pass one or more of none, int8, int4"),
    ("int8,none,int8", "--weights int8,none,int8: int8 given more than once; name each once"),
])
def test_bad_weights_are_a_one_line_error(weights, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        WeightOnly.parse_list(weights)


def test_bad_weights_on_the_command_line(tiny_ckpt):
    result = run_cli("matrix", "--model", str(tiny_ckpt), "--gpus", "4090d", "--weights",
                     "int8,fp8")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip() == "error: --weights fp8: one of none, int8, int4"
    with pytest.raises(ConfigError) as build_says:  # one parser, one message
        BuildOptions(str(tiny_ckpt), "4090d", weights="fp8")
    assert result.stderr.strip() == f"error: {build_says.value}"


def test_workflow_uses_only_fields_the_matrix_has():
    text = WORKFLOW.read_text()
    workflow = yaml.safe_load(text)
    jobs = workflow["jobs"]
    assert "qvl-trt matrix" in " ".join(s.get("run", "") for s in jobs["matrix"]["steps"])
    used = set(re.findall(r"\$\{\{\s*matrix\.(\w+)", text))
    assert used <= set(SCHEMA["$defs"]["job"]["properties"]), used
    assert {"runner", "container", "cache_key", "cache_prefix", "build_dir", "weights"} <= used
    for name in ("prepare", "engines"):
        assert "fromJSON(needs.matrix.outputs.matrix)" in jobs[name]["strategy"]["matrix"]
    engines = " ".join(s.get("run", "") for s in jobs["engines"]["steps"])
    assert "qvl-trt build --resume" in engines
    # Both build invocations take the job's precision (the resume checks it).
    prepare = " ".join(s.get("run", "") for s in jobs["prepare"]["steps"])
    for run in (prepare, engines):
        (build,) = re.findall(r"qvl-trt build [^\n]*", run.replace("\\\n", " "))
        assert '--weights "${{ matrix.weights }}"' in build, build
    # Artifacts of one run are apart per job.
    names = [s["with"]["name"] for name in ("prepare", "engines")
             for s in jobs[name]["steps"] if s.get("uses", "").startswith("actions/upload")]
    assert names and all("${{ matrix.gpu }}-${{ matrix.weights }}" in n for n in names)
    saves = [s for s in jobs["engines"]["steps"] if s.get("uses", "").startswith(
        "actions/cache/save")]
    assert saves and saves[0]["with"]["key"] == "${{ matrix.cache_key }}"
