"""The LLM engine stage where TensorRT-LLM is absent: the BuildConfig derived from every
shipped profile, the stop with exit code 3 after the checkpoint conversion, and `--resume`.
The engine build itself is tests/test_llm_engine_trtllm.py (NGC container, GPU)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys

import pytest
from cli_harness import run_cli

from qvl_trt import __version__
from qvl_trt.build import Stage, resume_build
from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.deploy.container import TRTLLM_CONTAINER
from qvl_trt.errors import BuildError, ConfigError, StageUnavailable
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.engine import _run_rank, build_engines, engine_build_config
from qvl_trt.manifest import IMAGE_DIR
from qvl_trt.plan import make_plan
from qvl_trt.profiles import load_profile, profile_names
from qvl_trt.testing.tiny_checkpoint import write_config_only

# tensorrt_llm.builder.BuildConfig's fields and the PluginConfig fields we set, as read in the
# TensorRT-LLM 1.2 sources. BuildConfig.from_dict pops the keys it knows and silently drops
# the rest, so a misspelt key would be lost without this check.
BUILD_CONFIG_FIELDS = {
    "max_input_len", "max_seq_len", "opt_batch_size", "max_batch_size", "max_beam_width",
    "max_num_tokens", "opt_num_tokens", "max_prompt_embedding_table_size", "kv_cache_type",
    "gather_context_logits", "gather_generation_logits", "strongly_typed",
    "force_num_profiles", "profiling_verbosity", "enable_debug_output", "max_draft_len",
    "speculative_decoding_mode", "use_refit", "input_timing_cache", "output_timing_cache",
    "lora_config", "weight_sparsity", "weight_streaming", "plugin_config", "use_strip_plan",
    "max_encoder_input_len", "dry_run", "visualize_network", "monitor_memory", "use_mrope",
}
PLUGIN_CONFIG_FIELDS = {
    "gemm_plugin", "gpt_attention_plugin", "paged_kv_cache", "remove_input_padding",
    "context_fmha", "use_paged_context_fmha", "tokens_per_block", "multiple_profiles",
    "weight_only_quant_matmul_plugin",
}
needs_no_trtllm = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is not None,
    reason="TensorRT-LLM is installed here, so the llm stage builds instead of stopping; "
    "tests/test_llm_engine_trtllm.py covers the build")


@pytest.mark.parametrize("name", profile_names())
def test_build_config_follows_the_profile(name, tmp_path_factory):
    profile = load_profile(name)
    lim = profile.limits
    config = engine_build_config(profile, deepstack_layers=3)
    assert set(config) <= BUILD_CONFIG_FIELDS and set(config["plugin_config"]) <= PLUGIN_CONFIG_FIELDS
    assert {k: config[k] for k in ("max_batch_size", "max_input_len", "max_seq_len",
                                   "max_num_tokens")} == {
        "max_batch_size": lim.max_batch_size, "max_input_len": lim.max_input_len,
        "max_seq_len": lim.max_seq_len, "max_num_tokens": lim.max_num_tokens}
    assert config["max_prompt_embedding_table_size"] == (
        lim.max_batch_size * 4 * lim.max_visual_tokens_per_request)
    assert config["use_mrope"] is True and config["max_beam_width"] == 1
    assert config["plugin_config"] == {
        "gemm_plugin": "float16", "gpt_attention_plugin": "float16", "paged_kv_cache": True,
        "remove_input_padding": True, "context_fmha": True, "use_paged_context_fmha": True,
        "tokens_per_block": lim.tokens_per_block, "multiple_profiles": True}
    # The planner reserves the same prompt-table buffer the engine will allocate.
    model = tmp_path_factory.getbasetemp() / "config-2b"
    if not model.exists():
        write_config_only(model, "2b")
    assert make_plan(open_checkpoint(model), profile).prompt_table_rows == \
        config["max_prompt_embedding_table_size"]


def test_build_config_dtypes():
    profile = load_profile("h100")
    bf16 = engine_build_config(profile, deepstack_layers=3, dtype="bfloat16")["plugin_config"]
    assert bf16["gemm_plugin"] == bf16["gpt_attention_plugin"] == "bfloat16"
    assert bf16["context_fmha"] is True and bf16["use_paged_context_fmha"] is True
    with pytest.raises(ConfigError, match="^LLM engine dtype float32 cannot place image tokens: "
                       "MRoPE needs fused context attention, which TensorRT-LLM has only for "
                       "float16 and bfloat16; build with one of those$"):
        engine_build_config(profile, deepstack_layers=3, dtype="float32")
    with pytest.raises(ConfigError, match="'int8' is not one of float16, bfloat16, float32"):
        engine_build_config(profile, deepstack_layers=3, dtype="int8")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weight_only_build_config_names_the_plugin(weights):
    profile = load_profile("4090d")
    plain = engine_build_config(profile, deepstack_layers=3)
    config = engine_build_config(profile, deepstack_layers=3, weights=weights)
    assert "weight_only_quant_matmul_plugin" not in plain["plugin_config"]
    assert config["plugin_config"] == {**plain["plugin_config"],
                                       "weight_only_quant_matmul_plugin": "float16"}
    assert {k: v for k, v in config.items() if k != "plugin_config"} == {
        k: v for k, v in plain.items() if k != "plugin_config"}


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory):
    """dtype (or weight-only mode) -> the tiny checkpoint converted at the 4090d profile's
    max_seq_len."""
    root = tmp_path_factory.mktemp("converted")
    max_seq_len = load_profile("4090d").limits.max_seq_len
    out = {dtype: convert_checkpoint(tiny_ckpt, root / dtype, max_seq_len=max_seq_len,
                                     dtype=dtype).out for dtype in ("float16", "float32")}
    out["int4"] = convert_checkpoint(tiny_ckpt, root / "int4", max_seq_len=max_seq_len,
                                     weights="int4").out
    return out


def _edited(**plugins) -> dict:
    """engine_build_config's settings with plugin_config keys changed (as by hand in
    build_config.json); None removes a key."""
    config = engine_build_config(load_profile("4090d"), deepstack_layers=3)
    plugin_config = {**config["plugin_config"], **plugins}
    return {**config, "plugin_config": {k: v for k, v in plugin_config.items()
                                        if v is not None}}


@pytest.mark.parametrize("dtype, settings, reason", [
    ("float16", _edited(context_fmha=False), "build_config.json sets context_fmha False"),
    ("float16", _edited(context_fmha="disable"), "build_config.json sets context_fmha disable"),
    ("float16", _edited(context_fmha=None), "build_config.json sets context_fmha None"),
    ("float16", _edited(gpt_attention_plugin="float32"), "gpt_attention_plugin is float32"),
    ("float32", _edited(), "checkpoint dtype is float32"),
    ("float32", _edited(gpt_attention_plugin="auto"), "checkpoint dtype is float32"),
])
def test_rank_child_refuses_unfused_context_attention(converted, tmp_path, dtype, settings,
                                                      reason):
    """The rank child (what reproduce.sh runs) re-checks the settings it reads, with or
    without TensorRT-LLM: a hand-edited build_config.json or a float32 checkpoint would make
    the plugin fall back to unfused attention, which ignores the MRoPE table."""
    with pytest.raises(BuildError, match=f"{reason}: MRoPE needs fused context attention"):
        build_engines(converted[dtype], tmp_path, settings)


@needs_no_trtllm
def test_rank_child_passes_the_shipped_settings_on(converted, tmp_path):
    """The check above lets engine_build_config's own settings through to TensorRT-LLM."""
    with pytest.raises(StageUnavailable, match="tensorrt_llm"):
        build_engines(converted["float16"], tmp_path, _edited())
    int4 = engine_build_config(load_profile("4090d"), deepstack_layers=3, weights="int4")
    with pytest.raises(StageUnavailable, match="tensorrt_llm"):
        build_engines(converted["int4"], tmp_path / "int4", int4)


@pytest.mark.parametrize("plugin", [None, "float32", "bfloat16"])
def test_rank_child_refuses_weight_only_without_its_plugin(converted, tmp_path, plugin):
    """A weight-only checkpoint needs the WeightOnlyQuantMatmul plugin in its own dtype
    (INT4 has no other path; INT8's Q/DQ fallback would misread the GEMM-ready weights)."""
    with pytest.raises(BuildError, match=f"sets weight_only_quant_matmul_plugin {plugin}, the "
                       "checkpoint is weight-only int4 \\(W4A16\\) in float16"):
        build_engines(converted["int4"], tmp_path,
                      _edited(weight_only_quant_matmul_plugin=plugin))


def test_child_exit_codes_become_build_errors(tmp_path):
    def child(code: int) -> list[str]:
        return [sys.executable, "-c", f"print('log line'); print('the reason'); exit({code})"]

    with pytest.raises(StageUnavailable, match="^the reason$"):
        _run_rank(0, child(3), tmp_path)
    with pytest.raises(BuildError, match=r"rank 1 failed \(exit code 2\): log line \| the "
                       r"reason\. Full log: .*build-rank1\.log; reproduce with: bash "
                       r".*reproduce\.sh"):
        _run_rank(1, child(2), tmp_path)
    assert (tmp_path / "build-rank1.log").read_text() == "log line\nthe reason\n"


@pytest.fixture(scope="module")
def stopped_build(tiny_ckpt, tmp_path_factory):
    """`qvl-trt build --only llm` run where tensorrt_llm cannot be imported."""
    out = tmp_path_factory.mktemp("llm") / "b"
    result = run_cli("build", "-m", str(tiny_ckpt), "-g", "4090d", "-o", str(out), "--only",
                     "llm", block=("tensorrt_llm",))
    return out, result


@needs_no_trtllm
def test_llm_stage_stops_after_the_checkpoint_with_exit_3(stopped_build, tiny_ckpt):
    out, result = stopped_build
    assert result.returncode == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1]
    message = errors[0]
    assert "Traceback" not in result.stderr
    # TensorRT-LLM is not a pip install into this environment: the fix is the container.
    assert "tensorrt_llm" in message and "pip install" not in message
    assert "comes with NVIDIA's TensorRT-LLM container" in message
    assert f"converted checkpoint is kept in {out / 'llm_checkpoint'}" in message
    build, run = message[message.index("docker build "):].split(" && ")
    # The serving image recipe is written into the build folder; its tag runs the resume.
    tag = f"qvl-trt:{__version__}-rtx"
    assert shlex.split(build) == ["docker", "build", "-t", tag, str(out / IMAGE_DIR)]
    assert f"FROM {TRTLLM_CONTAINER}\n" in (out / IMAGE_DIR / "Dockerfile").read_text()
    docker = shlex.split(run)
    assert f"{out}:{out}" in docker and f"{tiny_ckpt}:{tiny_ckpt}" in docker
    assert docker[docker.index(tag) + 1:] == ["qvl-trt", "build", "--resume", str(out)]

    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"inspect", "plan", "llm_checkpoint"}
    record = manifest["stages"]["llm_checkpoint"]
    assert set(record["outputs"]) == {"config.json", "rank0.safetensors"}
    assert record["inputs"]["max_seq_len"] == load_profile("4090d").limits.max_seq_len
    config = json.loads((out / "llm_checkpoint" / "config.json").read_text())
    assert config["max_position_embeddings"] == load_profile("4090d").limits.max_seq_len
    assert not (out / "llm").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"]


@needs_no_trtllm
def test_resume_skips_the_converted_checkpoint(stopped_build):
    out, first = stopped_build
    assert first.returncode == 3
    before = json.loads((out / "manifest.json").read_text())["stages"]["llm_checkpoint"]
    mtime = (out / "llm_checkpoint" / "rank0.safetensors").stat().st_mtime_ns

    again = run_cli("build", "--resume", str(out), "--only", "llm", block=("tensorrt_llm",))
    assert again.returncode == 3, again.stderr
    assert "stage llm_checkpoint: unchanged, skipped" in again.stderr
    with pytest.raises(StageUnavailable, match="qvl-trt build --resume"):
        resume_build(out, only=(Stage.LLM,))

    after = json.loads((out / "manifest.json").read_text())["stages"]["llm_checkpoint"]
    assert after["finished_at"] == before["finished_at"]
    assert after["outputs"] == before["outputs"]
    assert (out / "llm_checkpoint" / "rank0.safetensors").stat().st_mtime_ns == mtime
