"""`qvl-trt repo`, `validate` and `serve --dry-run`, and the build's repo stage, on the tiny
build: repositories are self-contained and valid; broken ones fail with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import run_cli

from qvl_trt.atomic import leftovers
from qvl_trt.build import Stage, resume_build
from qvl_trt.deps import available
from qvl_trt.dtypes import Dtype
from qvl_trt.errors import ConfigError
from qvl_trt.machine import detect_gpus
from qvl_trt.manifest import BUILD_CONFIG_NAME
from qvl_trt.serve.needs import point_engine_paths, read_needs
from qvl_trt.testing.trt_layout import linked_copy, write_llm_engine_layout
from qvl_trt.triton import contract as c
from qvl_trt.triton.layout import RUNTIME_ZIP
from qvl_trt.triton.options import Flavor, default_postprocessing_instances, machine_cores
from qvl_trt.triton.pbconfig import (
    CONFIG_FILE,
    data_type,
    parameters,
    parse_config,
    pb2,
    read_config,
    to_text,
)
from qvl_trt.triton.repository import (
    BuildInput,
    RepoOptions,
    write_repo,
)
from qvl_trt.triton.tensorrtllm_backend import EngineLimits
from qvl_trt.triton.validate import validate_repo

pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'qvl-trt[serve]'")

needs_rtx = pytest.mark.skipif(
    not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
    reason="the trt flavor needs the tiny vision engine, built with TensorRT-RTX: "
    "pip install 'qvl-trt[rtx]'")


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
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import qvl_trt.triton.runtime.postprocessing, "
             "qvl_trt; print(qvl_trt.__file__)")
    done = subprocess.run([sys.executable, "-c", probe, str(zips[0])], capture_output=True,
                          text=True, cwd=tmp_path, check=True)
    assert done.stdout.strip().startswith(str(zips[0]))
    # One preprocessing instance per core of this machine unless told otherwise.
    pre = parse_config((repo / "preprocessing" / CONFIG_FILE).read_text(), "preprocessing")
    assert [g.count for g in pre.instance_group] == [machine_cores()]
    for model in ("postprocessing", "tensorrt_llm_bls"):
        assert [g.count for g in read_config(repo / model).instance_group] == [
            default_postprocessing_instances()]
    # The reference tower normalises the 8-bit pixels with the image processor settings.
    (repo / "vision_encoder" / "1" / "checkpoint" / "preprocessor_config.json").unlink()
    assert any("preprocessor_config.json is missing" in p for p in problems(repo))
    # tensorrt_llm reads the engine's limits where the trt flavor's executor reads them: from
    # the build config of the engine this profile gets.
    written = json.loads((repo / "tensorrt_llm" / "1" / BUILD_CONFIG_NAME).read_text())
    assert EngineLimits.of_build_config(written) == EngineLimits(
        max_seq_len=1024, max_num_tokens=1024, tokens_per_block=32, paged_context_fmha=True)
    (repo / "tensorrt_llm" / "1" / BUILD_CONFIG_NAME).unlink()
    assert any(f"tensorrt_llm/1/{BUILD_CONFIG_NAME} is missing" in p for p in problems(repo))



def _retype(name: str, outputs: bool = False):
    def edit(config) -> None:
        tensors = config.output if outputs else config.input
        next(t for t in tensors if t.name == name).data_type = data_type("INT32")

    return edit


def _drop_position_ids(repo: Path) -> None:
    def drop(config) -> None:
        kept = [i for i in config.input if i.name != c.MROPE_POSITION_IDS]
        del config.input[:]
        config.input.extend(kept)

    edit_config(repo / "postprocessing", drop)
    edit_config(repo / "ensemble", lambda cfg: cfg.ensemble_scheduling.step[2].input_map.pop(
        c.MROPE_POSITION_IDS))


# breakage -> (how, a phrase of the reason validate must give)
CALL_BREAKAGES = {
    "step missing": (lambda r: edit_config(r / "tensorrt_llm_bls", lambda cfg: cfg.parameters[
        "preprocessing_model"].__setattr__("string_value", "nowhere")),
        "tensorrt_llm_bls: calls nowhere, which is not in the repository"),
    "llm input retyped": (lambda r: edit_config(r / "tensorrt_llm",
                                                _retype(c.MROPE_POSITION_DELTAS)),
                          "tensorrt_llm_bls -> tensorrt_llm: mrope_position_deltas: dtype INT64 "
                          "is produced, INT32 expected"),
    # The callers build the MRoPE table the stock backend needs on every request from these.
    "no position ids": (_drop_position_ids, "postprocessing -> tensorrt_llm: does not send "
                        "mrope_rotary_cos_sin"),
    "position ids retyped": (lambda r: edit_config(r / "preprocessing", _retype(
        c.MROPE_POSITION_IDS, outputs=True)), "tensorrt_llm_bls: mrope_position_ids: dtype "
        "INT32 is produced, INT64 expected"),
    # the reference model reads the stock backend's guided decoding parameters
    "guided decoding half off": (lambda r: _set_parameter("guided_decoding_backend", "")(r),
                                 "tensorrt_llm: guided decoding is off: guided_decoding_backend "
                                 "is '', xgrammar_tokenizer_info_path 'xgrammar_tokenizer_info"
                                 ".json', and the backend needs both"),
    "bls takes no guide": (lambda r: _drop_input("tensorrt_llm_bls",
                                                 c.GUIDED_DECODING_GUIDE_TYPE)(r),
                           "tensorrt_llm_bls -> tensorrt_llm: does not forward "
                           "guided_decoding_guide_type"),
    # the callers admit requests to tensorrt_llm's batch (runtime/admission.py)
    "more slots than the batch": (lambda r: _set_parameter("batch_slots", "9",
                                                           "postprocessing")(r),
                                  "postprocessing: batch_slots is 9, tensorrt_llm's "
                                  "max_batch_size is 8: they must be equal"),
    "two queues": (lambda r: _set_parameter("max_queue", "3", "tensorrt_llm_bls")(r),
                   "tensorrt_llm: its callers postprocessing, tensorrt_llm_bls differ in "
                   "max_queue or max_queue_wait_s, though they share one queue"),
    "probe flag dropped": (lambda r: edit_config(r / "ensemble", lambda cfg: (
        cfg.ensemble_scheduling.step[2].input_map.pop(c.HEALTH_PROBE))),
                           "ensemble -> postprocessing: does not map the ensemble input "
                           "health_probe"),
}


@pytest.mark.parametrize("breakage", list(CALL_BREAKAGES))
def test_tensorrt_llm_calls_are_validated(tmp_path, tiny_build, breakage) -> None:
    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path
    how, reason = CALL_BREAKAGES[breakage]
    how(repo)
    found = problems(repo)
    assert any(reason in p for p in found), found


def test_a_parameter_the_model_would_not_read_is_a_problem(tmp_path, tiny_build) -> None:
    """validate reads a BLS caller's parameters as its model.py does (contract.py's
    dataclasses): a mistyped or missing one is reported, not found at load time."""
    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path
    edit_config(repo / "postprocessing", lambda cfg: cfg.parameters[
        "max_queue"].__setattr__("string_value", "many"))
    edit_config(repo / "tensorrt_llm_bls", lambda cfg: cfg.parameters.pop("batch_slots"))
    found = problems(repo)
    assert any("postprocessing" in p and "max_queue: expected an integer, got 'many'" in p
               for p in found), found
    assert any("tensorrt_llm_bls" in p and "missing key 'batch_slots'" in p
               for p in found), found


def test_postprocessing_instances_are_written_planned_and_validated(tmp_path,
                                                                    tiny_build) -> None:
    """The token hop's instance count: written to postprocessing and tensorrt_llm_bls, serve
    sizes the BLS threads for the requests the build admits (its callers' instances share
    its places), validate refuses counts the writer would not write (and a tensorrt_llm of
    several instances)."""
    from qvl_trt.triton.model_configs import pb_kind

    assert [default_postprocessing_instances(n) for n in (1, 2, 4, 8, 16, 64)] == [
        1, 1, 1, 2, 4, 4]
    with pytest.raises(ConfigError, match="postprocessing_instances is 0; give 1 or more"):
        RepoOptions(postprocessing_instances=0)
    repo = write_repo([BuildInput(tiny_build)], tmp_path / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, postprocessing_instances=3)).path
    callers = ("postprocessing", "tensorrt_llm_bls")
    configs = {m: read_config(repo / m) for m in callers}
    assert all([g.count for g in cfg.instance_group] == [3] for cfg in configs.values())
    admitted = {c.llm_caller_parameters(parameters(cfg), m).capacity
                for m, cfg in configs.items()}
    assert admitted == {8 + 4 * 8}  # the tiny profile's batch and the default queue
    assert read_needs(repo).bls_callers == 8 + 4 * 8 + 1  # and the probe
    assert problems(repo) == []
    done = run_cli("repo", "--build", str(tiny_build), "--out", str(tmp_path / "cli"),
                   "--flavor", "reference", "--postprocessing-instances", "2")
    assert done.returncode == 0, done.stderr
    assert [g.count for g in read_config(tmp_path / "cli" / "postprocessing").instance_group] \
        == [2]

    def set_group(count: int, kind: str = "KIND_CPU"):
        def edit(config) -> None:
            config.instance_group[0].count = count
            config.instance_group[0].kind = pb_kind(kind)
        return edit

    edit_config(repo / "postprocessing", set_group(0))
    edit_config(repo / "tensorrt_llm_bls", set_group(2, "KIND_GPU"))
    edit_config(repo / "tensorrt_llm", set_group(2))
    found = problems(repo)
    assert any(p.startswith("postprocessing: instance group of count 0, KIND_CPU: write "
                            "KIND_CPU and a count of 1 or more") for p in found), found
    assert any(p.startswith("tensorrt_llm_bls: instance group of count 2, KIND_GPU")
               for p in found), found
    assert "tensorrt_llm: runs 2 instances, each with its own engine and KV cache (the plan " \
        "holds one); write an instance count of 1" in found


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


def test_a_table_dtype_numpy_cannot_hold_is_refused(tmp_path, tiny_build) -> None:
    with pytest.raises(ConfigError, match="^LLM dtype bfloat16 is not supported by the "
                                          "repository's python models, which move tensors as "
                                          r"numpy \(float16, float32\)$"):
        write_repo([BuildInput(tiny_build)], tmp_path / "bf16",
                   RepoOptions(flavor=Flavor.REFERENCE, reference_dtype=Dtype.BFLOAT16))
    assert not (tmp_path / "bf16").exists()


def test_repo_command_and_build_stage(tmp_path, tiny_build) -> None:
    out = tmp_path / "repo"
    done = run_cli("repo", "--build", str(tiny_build), "--out", str(out), "--flavor",
                   "reference")
    assert done.returncode == 0, done.stderr
    assert "wrote the reference repository" in done.stdout
    # --flavor is enum-typed: Typer refuses other names and lists the choices.
    bad = run_cli("repo", "--build", str(tiny_build), "--out", str(tmp_path / "x"), "--flavor",
                  "pytorch")
    text = " ".join(bad.stderr.replace("│", " ").split())
    assert bad.returncode == 2 and "'pytorch' is not one of 'trt', 'reference'" in text
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


def _retype_pixels(repo: Path) -> None:
    def retype(config) -> None:
        next(i for i in config.input if i.name == "pixel_values").data_type = data_type("FP16")

    edit_config(repo / "vision_encoder", retype)


def _set_parameter(key: str, value: str | None, model: str = "tensorrt_llm"):
    def edit(repo: Path) -> None:
        def change(config) -> None:
            if value is None:
                del config.parameters[key]
            else:
                config.parameters[key].string_value = value

        edit_config(repo / model, change)

    return edit


def _edit_engine_config(edit):
    def apply(repo: Path) -> None:
        path = repo / "tensorrt_llm" / "1" / "engine" / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))

    return apply


def _replace_in(relative: str, old: str, new: str):
    def apply(repo: Path) -> None:
        path = repo / relative
        path.write_text(path.read_text().replace(old, new))

    return apply


def _drop_input(model: str, name: str):
    def edit(repo: Path) -> None:
        def drop(config) -> None:
            kept = [i for i in config.input if i.name != name]
            del config.input[:]
            config.input.extend(kept)

        edit_config(repo / model, drop)

    return edit


def _set_input_type(model: str, name: str, data_type: str):
    def edit(repo: Path) -> None:
        def retype(config) -> None:
            for tensor in config.input:
                if tensor.name == name:
                    tensor.data_type = pb2().DataType.Value(data_type)

        edit_config(repo / model, retype)

    return edit


def _edit_tokenizer_info(edit):
    def apply(repo: Path) -> None:
        path = repo / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json"
        info = json.loads(path.read_text())
        edit(info)
        path.write_text(json.dumps(info))

    return apply


def _unmap_guide(repo: Path) -> None:
    edit_config(repo / "ensemble", lambda cfg: cfg.ensemble_scheduling.step[2].input_map.pop(
        c.GUIDED_DECODING_GUIDE_TYPE))


# breakage -> (how, a phrase of the reason validate must give)
BREAKAGES = {
    "map dtype": (_retype_pixels,
                  "_pixel_values -> pixel_values: dtype UINT8 is produced, FP16 expected"),
    "llm engine": (lambda r: (r / "tensorrt_llm" / "1" / "engine" / "rank0.engine").unlink(),
                   "LLM engine rank0.engine is missing"),
    "vision engine": (lambda r: (r / "vision_encoder" / "1" / "engine" / "model.engine").unlink(),
                      "vision engine engine/model.engine (+ config.json) is missing"),
    # An engine of the float-pixel era: it would be fed the 8-bit values.
    "float pixels": (_replace_in("vision_encoder/1/engine/config.json", '"uint8"', '"float32"'),
                     "vision engine takes float32 pixel_values, this qvl-trt sends the images' "
                     "uint8 values"),
    "edition": (_replace_in("vision_encoder/1/engine/config.json", '"tensorrt_rtx"',
                            '"tensorrt"'),
                "vision engine was built with tensorrt, the repository's profile"),
    "placeholder": (_set_parameter("gpt_model_path", "${engine_dir}"),
                    "holds an unfilled ${...} placeholder"),
    "stray folder": (lambda r: (r / ".cache").mkdir(), "no config.pbtxt: Triton loads every folder"),
    # the stock backend's no-fallback keys, booleans and enums (tensorrtllm_backend.py)
    "no tokenizer_dir": (_set_parameter("tokenizer_dir", None),
                         "tensorrt_llm: parameter tokenizer_dir is missing"),
    "no xgrammar path": (_set_parameter("xgrammar_tokenizer_info_path", None),
                         "tensorrt_llm: parameter xgrammar_tokenizer_info_path is missing"),
    "no guided backend": (_set_parameter("guided_decoding_backend", None),
                          "tensorrt_llm: parameter guided_decoding_backend is missing"),
    "chunked yes": (_set_parameter("enable_chunked_context", "yes"),
                    "tensorrt_llm: parameter enable_chunked_context is 'yes'"),
    "policy misspelled": (_set_parameter("batch_scheduler_policy", "guaranted_no_evict"),
                          "tensorrt_llm: parameter batch_scheduler_policy is 'guaranted_no_evict'"),
    "sink tokens": (_set_parameter("sink_token_length", "4"),
                    "parameter sink_token_length is '4': sink tokens"),
    # what this pipeline needs of the backend and the engine
    "no kv budget": (_set_parameter("max_tokens_in_paged_kv_cache", None),
                     "max_tokens_in_paged_kv_cache is not set"),
    "kv over budget": (_set_parameter("max_tokens_in_paged_kv_cache", "99999999"),
                       "exceeds the planned KV budget"),
    "input in output": (_set_parameter("exclude_input_in_output", "false"),
                        "exclude_input_in_output must be true"),
    "fp32 engine": (_edit_engine_config(lambda c: c["pretrained_config"].update(dtype="float32")),
                    "LLM engine dtype is float32: MRoPE needs fused context attention"),
    "fmha off": (_edit_engine_config(
        lambda c: c["build_config"]["plugin_config"].update(context_fmha=False)),
        "LLM engine was built with context_fmha off"),
    "streamingllm": (_edit_engine_config(
        lambda c: c["build_config"]["plugin_config"].update(streamingllm=True)),
        "LLM engine was built with streamingllm"),
    "paged context off": (_edit_engine_config(
        lambda c: c["build_config"]["plugin_config"].update(use_paged_context_fmha=False)),
        "enable_chunked_context needs an engine built with use_paged_context_fmha"),
    "chunk below one block": (_edit_engine_config(
        lambda c: c["build_config"]["plugin_config"].update(tokens_per_block=2048)),
        "enable_chunked_context: max_num_tokens 1024 is below one KV block (tokens_per_block "
        "2048)"),
    "table dtype": (_set_input_type("tensorrt_llm", c.PROMPT_EMBEDDING_TABLE, "TYPE_FP32"),
                    "prompt_embedding_table is FP32, the engine computes in FP16"),
    "table rows": (_edit_engine_config(
        lambda c: c["build_config"].update(max_prompt_embedding_table_size=7)),
        "max_prompt_embedding_table_size is 7, the plan for its profile says"),
    # 2^31 / 64 rows of the tiny model's 64 wide: at the 32-bit bound of lookup_plugin.
    "lookup plugin": (_edit_engine_config(lambda c: (
        c["build_config"]["plugin_config"].update(lookup_plugin="float16"),
        c["build_config"].update(max_prompt_embedding_table_size=2**31 // 64))),
        "LLM engine was built with lookup_plugin, which indexes the prompt table in 32 bits"),
    "build.json key": (_replace_in("ensemble/1/build.json", '"shm_bytes"', '"shm"'),
                       "unknown key 'shm'"),
    "build.json type": (_replace_in("ensemble/1/build.json", '"tp_size": 1', '"tp_size": "1"'),
                        "build.json.tp_size: expected an integer, got '1'; regenerate the "
                        "repository with `qvl-trt repo`"),
    # the MRoPE table the callers build against the engine's config
    "engine rope_theta": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(rotary_base=10000.0)),
        "postprocessing -> tensorrt_llm: builds the MRoPE table with rope_theta"),
    "bls rope_theta": (_set_parameter("rope_theta", "10000", model="tensorrt_llm_bls"),
                       "tensorrt_llm_bls -> tensorrt_llm: builds the MRoPE table with "
                       "rope_theta 10000.0, the LLM engine has rotary_base"),
    "engine positions": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(max_position_embeddings=2048)),
        "builds the MRoPE table with max_seq_len 1024, the LLM engine has "
        "max_position_embeddings 2048"),
    "engine max_seq_len": (_edit_engine_config(lambda c: c["build_config"].update(max_seq_len=2048)),
                           "max_position_embeddings 1024 is not its max_seq_len 2048"),
    "engine mrope_section": (_edit_engine_config(
        lambda c: c["pretrained_config"]["rotary_scaling"].update(mrope_section=[1, 2, 3])),
        "the LLM engine has rotary_scaling.mrope_section [1, 2, 3]"),
    "engine not interleaved": (_edit_engine_config(
        lambda c: c["pretrained_config"]["rotary_scaling"].update(mrope_interleaved=False)),
        "builds the MRoPE table with mrope_interleaved True, the LLM engine has "
        "rotary_scaling.mrope_interleaved False"),
    "engine head size": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(head_size=7)), "the LLM engine has head_size 7"),
    "engine rotary dim": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(rotary_embedding_dim=7)),
        "the LLM engine has rotary_embedding_dim 7"),
    "use_mrope off": (_edit_engine_config(lambda c: c["build_config"].update(use_mrope=False)),
                      "LLM engine was built without use_mrope"),
    "plain rope": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(position_embedding_type="rope_gpt_neox")),
        "position_embedding_type is rope_gpt_neox, not mrope"),
    "caller mrope_section": (_set_parameter("mrope_section", "8,8", model="postprocessing"),
                             "mrope_section '8,8' is not three slot counts"),
    # the longest prompt the executor takes against the profile's max_input_len
    "no chunked context": (lambda r: (
        _set_parameter("enable_chunked_context", "false")(r),
        _edit_engine_config(lambda c: c["build_config"].update(max_num_tokens=512))(r)),
        "without enable_chunked_context the executor refuses prompts above 512 tokens "
        "(min(max_seq_len - 1, max_num_tokens)), preprocessing admits 768"),
    "world size": (_edit_engine_config(
        lambda c: c["pretrained_config"]["mapping"].update(world_size=2)),
        "LLM engine has world size 2, the build says tp_size 1"),
    # weight-only engines (`build --weights`)
    "engine weights": (_edit_engine_config(
        lambda c: c["pretrained_config"]["quantization"].update(quant_algo="W8A16")),
        "LLM engine's quant_algo is W8A16, build.json says weights none (None)"),
    "weight-only plugin": (lambda r: (
        _replace_in("ensemble/1/build.json", '"weights": "none"', '"weights": "int4"')(r),
        _edit_engine_config(
            lambda c: c["pretrained_config"]["quantization"].update(quant_algo="W4A16"))(r)),
        "LLM engine is weight-only W4A16 but weight_only_quant_matmul_plugin is None, not its "
        "dtype float16"),
    # serve's progress reading rests on the backend's iteration stats (serve/progress.py)
    "no iteration stats": (_set_parameter("iter_stats_max_iterations", "0"),
                           "iter_stats_max_iterations is 0: the executor then keeps no "
                           "iteration stats"),
    "rare iteration stats": (_set_parameter("stats_check_period_ms", "60000"),
                             "stats_check_period_ms is 60000: serve reads the iteration "
                             "counter as progress"),
}




# guided decoding: the guide's way to tensorrt_llm, its parameters, the tokenizer info
GUIDED_BREAKAGES = {
    "guide not forwarded": (_drop_input("postprocessing", c.GUIDED_DECODING_GUIDE),
                            "postprocessing -> tensorrt_llm: does not forward "
                            "guided_decoding_guide: a client's guide would be dropped"),
    "llm takes no guide": (_drop_input("tensorrt_llm", c.GUIDED_DECODING_GUIDE_TYPE),
                           "forwards guided_decoding_guide_type, which is not an input of "
                           "tensorrt_llm"),
    "ensemble drops the guide": (_unmap_guide, "ensemble -> postprocessing: does not map the "
                                 "ensemble input guided_decoding_guide_type"),
    "guided half off": (_set_parameter("xgrammar_tokenizer_info_path", ""),
                        "guided decoding is off: guided_decoding_backend is 'xgrammar', "
                        "xgrammar_tokenizer_info_path '', and the backend needs both"),
    "info path elsewhere": (_set_parameter("xgrammar_tokenizer_info_path", "/models/info.json"),
                            "xgrammar_tokenizer_info_path '/models/info.json' does not name "
                            "this model's tensorrt_llm/1/xgrammar_tokenizer_info.json"),
    "no tokenizer info": (lambda r: (r / "tensorrt_llm/1/xgrammar_tokenizer_info.json").unlink(),
                          "tensorrt_llm/1/xgrammar_tokenizer_info.json is missing"),
    "tokenizer info not json": (_replace_in("tensorrt_llm/1/xgrammar_tokenizer_info.json",
                                            '"stop_token_ids"', '"stop_token_ids'),
                                "xgrammar_tokenizer_info.json is not a readable JSON file"),
    "tokenizer info lacks added tokens": (_edit_tokenizer_info(
        lambda i: i.update(encoded_vocab=i["encoded_vocab"][:151650])),
        "xgrammar_tokenizer_info.json does not match the tokenizer: 151650 tokens against "
        "its 151669 (added tokens included), first difference at id 151650"),
    "tokenizer info stop ids": (_edit_tokenizer_info(lambda i: i.update(stop_token_ids=[0])),
                                "stop_token_ids [0] are not the end tokens preprocessing ends "
                                "answers with [151645, 151643]"),
    "engine vocab below the tokenizer": (_edit_engine_config(
        lambda c: c["pretrained_config"].update(vocab_size=151000)),
        "has 151669 tokens, the LLM's vocab_size is 151000"),
}


@needs_rtx
@pytest.mark.parametrize("breakage", list(BREAKAGES) + list(GUIDED_BREAKAGES))
def test_broken_repository_fails_validate_with_the_reason(tmp_path, trt_repo, breakage) -> None:
    repo = Path(shutil.copytree(trt_repo, tmp_path / "repo"))
    how, reason = {**BREAKAGES, **GUIDED_BREAKAGES}[breakage]
    how(repo)
    found = problems(repo)
    assert any(reason in p for p in found), found
    if breakage == next(iter(BREAKAGES)):  # the CLI reports the same problems: once
        done = run_cli("validate", str(repo))
        assert done.returncode == 1 and "problem" in done.stdout and reason in done.stdout


@needs_rtx
def test_moved_repository_gets_its_engine_path_back(tmp_path, trt_repo) -> None:
    moved = Path(shutil.copytree(trt_repo, tmp_path / "elsewhere"))
    assert point_engine_paths(read_needs(moved)) == ["tensorrt_llm"]
    params = read_config(moved / "tensorrt_llm").parameters
    assert params["gpt_model_path"].string_value == str(
        moved.resolve() / "tensorrt_llm" / "1" / "engine")
    assert params["xgrammar_tokenizer_info_path"].string_value == str(
        moved.resolve() / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json")
    assert point_engine_paths(read_needs(moved)) == []
    assert problems(moved) == []


def set_engine_world_size(repo: Path, model: str, world: int) -> None:
    """Make the model's engine folder look like a TP build of `world` ranks."""
    engine = repo / model / "1" / "engine"
    config = json.loads((engine / "config.json").read_text())
    config["pretrained_config"]["mapping"].update(world_size=world, tp_size=world)
    (engine / "config.json").unlink()  # a hard link into the build: edit this copy only
    (engine / "config.json").write_text(json.dumps(config))
    for rank in range(world):
        (engine / f"rank{rank}.engine").write_bytes(b"placeholder")


@needs_rtx
def test_serve_takes_the_world_size_from_the_engines(tmp_path, trt_repo) -> None:
    one = run_cli("serve", str(trt_repo), "--dry-run")
    assert one.returncode == 0, one.stderr
    assert "mpirun" not in one.stdout and "thread-pool-size=" in one.stdout
    refused = run_cli("serve", str(trt_repo), "--world-size", "2", "--dry-run")
    assert refused.returncode == 1
    assert "--world-size 2 does not match the engines' world size (tensorrt_llm: 1)" in \
        refused.stderr


@needs_rtx
def test_serve_refuses_two_llm_models_when_one_is_tensor_parallel(tmp_path,
                                                                  tiny_vision_build) -> None:
    build = linked_copy(tiny_vision_build, tmp_path / "build")
    write_llm_engine_layout(build)
    repo = write_repo([BuildInput(build, "a"), BuildInput(build, "b")], tmp_path / "repo").path
    set_engine_world_size(repo, "b_tensorrt_llm", 2)
    done = run_cli("serve", str(repo), "--dry-run")
    assert done.returncode == 1
    assert "holds 2 tensorrt_llm models and b_tensorrt_llm use tensor parallelism" in \
        done.stderr


@needs_rtx
def test_serve_sizes_the_bls_thread_pool_from_the_callers(trt_repo) -> None:
    from qvl_trt.serve.needs import read_needs

    needs = read_needs(trt_repo)
    # postprocessing and tensorrt_llm_bls share the build's places: one BLS call each
    workers = {c.llm_caller_parameters(parameters(read_config(d)), d.name).workers
               for d in trt_repo.iterdir() if "batch_slots" in read_config(d).parameters}
    assert needs.bls_callers == 8 + 4 * 8 + 1 and workers == {needs.bls_callers}
    assert needs.thread_pool_size == max(32, needs.bls_callers + 8)
    done = run_cli("serve", str(trt_repo), "--dry-run")
    assert f"thread-pool-size={needs.thread_pool_size}" in done.stdout


@needs_rtx
def test_doctor_checks_what_serving_the_repository_needs(trt_repo) -> None:
    done = run_cli("doctor", "--repo", str(trt_repo), "--json")
    assert done.returncode in (0, 1), done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout)["serve_checks"]}
    assert checks["world size"]["ok"] and checks["world size"]["detail"].startswith("1 ")
    assert checks["vision_encoder engine"] == {"check": "vision_encoder engine", "ok": True,
                                               "detail": "tensorrt_rtx imports"}
    # Each python model loaded by a real tritonserver in this environment; the vision
    # engine needs a GPU to deserialize, which this machine lacks.
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert checks[f"{model} loads"] == {"check": f"{model} loads", "ok": True,
                                            "detail": "loaded"}
    vision = checks["vision_encoder loads"]
    if not detect_gpus():
        assert not vision["ok"] and "CUDA" in vision["detail"] and "\n" not in vision["detail"]
    assert "tensorrt_llm loads" not in checks and "ensemble loads" not in checks
    assert done.returncode == (0 if all(c["ok"] for c in checks.values()) else 1)


def test_a_small_dev_shm_gets_a_warning_with_the_docker_flag(tmp_path) -> None:
    from qvl_trt.serve.needs import ServeNeeds, warn_small_shm

    needs = ServeNeeds(tmp_path, (), {}, 0, 3 * 2**30 + 1, {})
    assert warn_small_shm(needs, 4 * 2**30) is None
    message = warn_small_shm(needs, 64 * 2**20)
    assert "/dev/shm has 0.1 GiB" in message and "--shm-size=4g or --ipc=host" in message


@needs_rtx
def test_serve_dry_run_prints_one_rank_per_gpu(tmp_path, trt_repo) -> None:
    repo = Path(shutil.copytree(trt_repo, tmp_path / "repo"))
    set_engine_world_size(repo, "tensorrt_llm", 2)
    done = run_cli("serve", str(repo), "--dry-run")
    assert done.returncode == 0, done.stderr
    line = " ".join(done.stdout.split())
    assert "mpirun" in line and line.count(" -n 1 ") == 2
    assert "--model-control-mode=explicit --load-model=tensorrt_llm" in line
    prefixes = sorted(set(part.split("=")[-1] for part in line.split()
                          if "shm-region-prefix-name" in part))
    assert len(prefixes) == 2 and prefixes[0].endswith("r0_") and prefixes[1].endswith("r1_")


def test_build_info_names_a_missing_or_mistyped_key(tmp_path) -> None:
    from qvl_trt.errors import ConfigError
    from qvl_trt.triton.layout import BuildInfo

    path = tmp_path / "build.json"
    path.write_text("{")
    with pytest.raises(ConfigError, match="is not JSON .*; regenerate the repository with"):
        BuildInfo.read(path)
    path.write_text(json.dumps({"qvl_trt": "0"}))
    with pytest.raises(ConfigError, match=r"build.json: missing key 'flavor'; regenerate the "
                       r"repository with `qvl-trt repo`"):
        BuildInfo.read(path)
