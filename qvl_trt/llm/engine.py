"""The LLM engine build: the TensorRT-LLM BuildConfig derived from a GPU profile, and the build
of a converted checkpoint into an engine folder (config.json + rank{N}.engine) that the stock
C++ runtime and the tensorrtllm Triton backend load.

Each tensor-parallel rank is built by `python -m qvl_trt.llm.engine` in a child process (the
protocol of qvl_trt/child.py), so a crash or an out-of-memory kill becomes a clean BuildError
and GPU memory is freed after each rank. A child that cannot import tensorrt_llm exits with
StageUnavailable's exit code, which the build turns into StageUnavailable (the build can be
resumed in the TensorRT-LLM container).

Engines are float16 or bfloat16 with fused context attention (context_fmha): the attention
plugin reads the MRoPE table only on that path, which TensorRT-LLM has for fp16/bf16 alone
(cpp/tensorrt_llm/common/attentionOp.cpp: "Fall back to unfused MHA because of unsupported
data type"); the unfused path rotates image tokens at their 1-D index, so text still looks
right while images land at wrong positions. engine_build_config refuses float32, and each
rank's child refuses a build_config.json (editable by hand) or checkpoint that would fall back.

Weight-only INT8/INT4 checkpoints (quant_algo W8A16/W4A16) hold their linears in the model
dtype; TensorRT-LLM's own loader quantizes them and lays them out for this GPU's mixed GEMM
(qvl_trt.llm.weight_only). They need the WeightOnlyQuantMatmul plugin in the engine dtype:
INT4 has no other path, and TensorRT-LLM's Q/DQ fallback for INT8 would read the GEMM-ready
integers as plain ones. The child checks both before building.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import write_json_atomic
from ..child import REPRODUCE_NAME, child_main, run_child, write_reproduce
from ..deps import require
from ..dtypes import LLM_ENGINE_DTYPE, Dtype, WeightOnly, pick
from ..errors import BuildError, ConfigError
from ..manifest import BUILD_CONFIG_NAME, LLM_ENGINE_DIR, TIMING_CACHE_NAME
from ..mm.prompt_table import rows_per_visual_token
from ..profiles import BuildLimits, GpuProfile
from .layout import DTYPES, LlmConfig, rank_files, read_llm_config

log = logging.getLogger(__name__)

# The dtypes TensorRT-LLM's fused context attention (the only reader of the MRoPE table) runs.
FUSED_ATTENTION_DTYPES = (Dtype.FLOAT16, Dtype.BFLOAT16)


# TensorRT refused a network input of 2^31 elements or more through 10.10 (NvInfer.h); the
# TensorRT-LLM container's 10.14 takes larger ones. The table lookup (functional.embedding in
# tensorrt_llm/functional.py) goes through lookup_plugin when the engine has it, whose kernel
# indexes rows in 32 bits (cpp/tensorrt_llm/kernels/lookupKernels.cu, word_index * n_embed).
TABLE_ELEMENT_LIMIT = 2**31


def prompt_table_element_bound(plugin_config: dict[str, Any]) -> int | None:
    """The most elements the engine's prompt table may hold: TABLE_ELEMENT_LIMIT when the
    lookup goes through lookup_plugin, else no bound (None). engine_build_config leaves the
    plugin off; a hand-edited build_config.json may turn it on."""
    return None if plugin_config.get("lookup_plugin") in (None, False, "disable") \
        else TABLE_ELEMENT_LIMIT


@dataclass(frozen=True)
class EngineBuild:
    engine_dir: Path
    tp_size: int
    engine_bytes: int


def prompt_table_rows(limits: BuildLimits, deepstack_layers: int) -> int:
    """max_prompt_embedding_table_size: every slot of a full batch at the per-request cap
    (limits.max_visual_tokens_per_request), each visual token with 1 + K rows. The runtime
    admits table / max_batch_size rows per request (PromptTuningBuffers, TensorRT-LLM
    cpp/tensorrt_llm/batch_manager/promptTuningBuffers.cpp), so the cap is exact per slot."""
    return (limits.max_batch_size * rows_per_visual_token(deepstack_layers)
            * limits.max_visual_tokens_per_request)


def engine_build_config(profile: GpuProfile, *, deepstack_layers: int,
                        dtype: Dtype | str = LLM_ENGINE_DTYPE,
                        weights: WeightOnly = WeightOnly.NONE) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.builder.BuildConfig.from_dict` for this profile.

    max_position_embeddings is not a BuildConfig field: the converted checkpoint carries it,
    equal to max_seq_len (the build checks), which sizes the per-request MRoPE table.
    Weight-only engines get the WeightOnlyQuantMatmul plugin in the engine dtype (what
    tensorrt_llm/builder.py build() would switch on for a weight-only model anyway; written
    here so build_config.json says it and the child can check it).
    """
    dtype = pick(dtype, DTYPES, "LLM engine dtype")
    if dtype not in FUSED_ATTENTION_DTYPES:
        raise ConfigError(f"LLM engine dtype {dtype} cannot place image tokens: MRoPE needs "
                          "fused context attention, which TensorRT-LLM has only for "
                          f"{' and '.join(FUSED_ATTENTION_DTYPES)}; build with one of those")
    lim = profile.limits
    weight_only = {} if WeightOnly(weights) is WeightOnly.NONE else {
        "weight_only_quant_matmul_plugin": dtype.value}
    return {
        "max_batch_size": lim.max_batch_size,
        "max_input_len": lim.max_input_len,
        "max_seq_len": lim.max_seq_len,
        "max_num_tokens": lim.max_num_tokens,
        "max_beam_width": 1,
        "max_prompt_embedding_table_size": prompt_table_rows(lim, deepstack_layers),
        # trtllm-build sets this only for qwen2_vl; the runtime feeds the MRoPE inputs on it.
        "use_mrope": True,
        "strongly_typed": True,
        "plugin_config": {
            "gemm_plugin": dtype.value,
            "gpt_attention_plugin": dtype.value,
            "paged_kv_cache": True,
            "remove_input_padding": True,
            "context_fmha": True,
            "use_paged_context_fmha": True,
            "tokens_per_block": lim.tokens_per_block,
            "multiple_profiles": True,
            **weight_only,
        },
    }


def build_engines(checkpoint: Path, work: Path, build_config: dict[str, Any]) -> EngineBuild:
    """Build every rank of the converted checkpoint at `checkpoint` into `work/engine/`.

    Beside it: build_config.json (what the ranks were built with), build-rank{N}.log and
    reproduce.sh. Raises StageUnavailable when tensorrt_llm cannot be imported here.
    """
    checkpoint, work = Path(checkpoint).resolve(), Path(work)
    tp_size = read_llm_config(checkpoint).tp_size
    # Relative paths: the children run in `work`, which the build renames when complete.
    settings = {**build_config, "input_timing_cache": TIMING_CACHE_NAME,
                "output_timing_cache": TIMING_CACHE_NAME}
    write_json_atomic(work / BUILD_CONFIG_NAME, settings)
    (work / LLM_ENGINE_DIR).mkdir(exist_ok=True)
    commands = [rank_command(checkpoint, rank) for rank in range(tp_size)]
    write_reproduce(work / REPRODUCE_NAME, [shlex.join(c) for c in commands],
                    "Rebuild the LLM engine ranks of this folder.")
    for rank, command in enumerate(commands):
        _run_rank(rank, command, work)
    engine_dir = work / LLM_ENGINE_DIR
    size = sum(p.stat().st_size for p in engine_dir.glob("rank*.engine"))
    return EngineBuild(engine_dir, tp_size, size)


def rank_command(checkpoint: Path, rank: int) -> list[str]:
    """The child command that builds one rank (run in the stage folder)."""
    return [sys.executable, "-m", "qvl_trt.llm.engine", str(checkpoint), LLM_ENGINE_DIR, str(rank),
            BUILD_CONFIG_NAME]


def _run_rank(rank: int, command: list[str], work: Path) -> None:
    log.info("building LLM engine rank %d (TensorRT-LLM, child process)", rank)
    run_child(command, cwd=work, log_path=work / f"build-rank{rank}.log",
              what=f"TensorRT-LLM's build of LLM engine rank {rank}",
              reproduce=work / REPRODUCE_NAME)


# ---- child process -----------------------------------------------------------------------

def check_fused_context_attention(settings: dict[str, Any], checkpoint_dtype: Dtype) -> None:
    """Raise BuildError unless these BuildConfig settings and checkpoint dtype give the
    attention plugin its fused context path, the only one that reads the MRoPE table."""
    plugins = settings.get("plugin_config", {})
    # PluginConfig.update_from_dict takes "enable" for True; a missing key is refused too,
    # since engine_build_config always writes it.
    if plugins.get("context_fmha") not in (True, "enable"):
        raise BuildError(f"build_config.json sets context_fmha {plugins.get('context_fmha')}: "
                         "MRoPE needs fused context attention, or image tokens get wrong "
                         "positions; set plugin_config.context_fmha to true")
    # The plugin's type is its own setting; "auto" means the checkpoint's dtype.
    attention = plugins.get("gpt_attention_plugin", "auto")
    attention = checkpoint_dtype if attention == "auto" else attention
    for what, dtype in (("checkpoint dtype", checkpoint_dtype),
                        ("gpt_attention_plugin", attention)):
        if dtype not in FUSED_ATTENTION_DTYPES:
            raise BuildError(f"{what} is {dtype}: MRoPE needs fused context attention, which "
                             f"TensorRT-LLM has only for {' and '.join(FUSED_ATTENTION_DTYPES)}; "
                             "convert and build with float16 or bfloat16")


def check_weight_only(settings: dict[str, Any], checkpoint: LlmConfig) -> None:
    """Raise BuildError unless the BuildConfig settings run the checkpoint's weight-only
    linears through the WeightOnlyQuantMatmul plugin in the checkpoint's dtype."""
    if checkpoint.weight_only is WeightOnly.NONE:
        return
    plugin = settings.get("plugin_config", {}).get("weight_only_quant_matmul_plugin")
    plugin = checkpoint.dtype if plugin == "auto" else plugin
    if plugin != checkpoint.dtype:
        raise BuildError(
            f"build_config.json sets weight_only_quant_matmul_plugin {plugin}, the checkpoint "
            f"is weight-only {checkpoint.weight_only} ({checkpoint.quantization.quant_algo}) in "
            f"{checkpoint.dtype}: set plugin_config.weight_only_quant_matmul_plugin to "
            f"{checkpoint.dtype} (INT4 has no other path; INT8's Q/DQ fallback would misread "
            "the GEMM-ready weights)")


def _build_rank(checkpoint: Path, engine_dir: Path, rank: int, config_file: Path) -> None:
    settings = json.loads(config_file.read_text())
    converted = read_llm_config(checkpoint)
    # Checked before TensorRT-LLM is imported: refused anywhere, not only in its container.
    check_fused_context_attention(settings, converted.dtype)
    check_weight_only(settings, converted)
    rank_files(checkpoint, converted)
    require("tensorrt_llm", extra="trtllm", why="build the LLM engine")
    from tensorrt_llm.builder import BuildConfig, build
    from tensorrt_llm.logger import logger

    from .network import Qwen3VLConfig, Qwen3VLForCausalLM

    logger.set_level("info")
    config = Qwen3VLConfig.from_checkpoint(str(checkpoint))
    if config.max_position_embeddings != settings["max_seq_len"]:
        # Below max_seq_len the attention kernel would fall back to a path that ignores the
        # MRoPE table; above it every request's table grows for nothing.
        raise BuildError(f"{checkpoint} was converted with max_position_embeddings "
                         f"{config.max_position_embeddings}, the engine needs max_seq_len "
                         f"{settings['max_seq_len']}; convert again with that max_seq_len")
    # Weight-only (quant_algo W8A16/W4A16): PretrainedModel.__post_init__ swaps the decoder's
    # ColumnLinear/RowLinear for WeightOnlyQuant(Row)Linear (tensorrt_llm/quantization/
    # quantize.py weight_only_quantize; lm_head and the embedding are excluded by default, and
    # DeepStackEmbedding is no Embedding), and from_checkpoint's preprocess_weights
    # (tensorrt_llm/models/modeling_utils.py) quantizes the model-dtype linears and lays them
    # out for this GPU with the C++ op torch.ops.trtllm.symmetric_quantize_last_axis_of_
    # batched_matrix (tensorrt_llm/models/convert_utils.py weight_only_quantize_dict).
    model = Qwen3VLForCausalLM.from_checkpoint(str(checkpoint), rank=rank, config=config)
    engine = build(model, BuildConfig.from_dict(settings))
    engine.save(str(engine_dir))


def _main(argv: list[str]) -> None:
    checkpoint, engine_dir, rank, config_file = argv
    _build_rank(Path(checkpoint), Path(engine_dir), int(rank), Path(config_file))


if __name__ == "__main__":
    sys.exit(child_main(_main))
