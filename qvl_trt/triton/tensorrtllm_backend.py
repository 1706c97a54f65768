"""The parameters the stock tensorrtllm Triton backend reads from a model config, as it
parses them, and `check_parameters`, which is stricter than the backend.

Facts from TensorRT-LLM 1.2 `triton_backend/inflight_batcher_llm/src/`:
- model_state.cc `GetParameter<T>`: every value is a `string_value`; int32 through
  `std::stoi`, float through `std::stof`, bool only as True/true/TRUE/1/False/false/FALSE/0
  ("Cannot convert X to a boolean"). A missing key throws "Cannot find parameter with name".
- model_instance_state.cc: `gpt_model_type`, `tokenizer_dir`, `xgrammar_tokenizer_info_path`
  and `guided_decoding_backend` are read outside any try/catch, so a missing one fails the
  load (empty strings mean "not set"); every other key is read in a try/catch and falls back
  to a default with a warning: a malformed bool, a misspelled `batch_scheduler_policy` or
  `decoding_mode`, even a misspelled key, loads and silently runs with the default.

The backend accepts "12abc" as 12 and a misspelled enum as its default; `check_parameters`
refuses both, and any key the backend never reads (a misspelling it would ignore).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRUE = ("True", "true", "TRUE", "1")
FALSE = ("False", "false", "FALSE", "0")
GPT_MODEL_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")
BATCH_SCHEDULER_POLICIES = ("max_utilization", "guaranteed_no_evict")
DECODING_MODES = ("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter",
                  "lookahead", "eagle")
_INT = re.compile(r"[+-]?\d+")


class Kind(enum.Enum):
    STRING = "string"
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    CHOICE = "choice"


@dataclass(frozen=True)
class Param:
    kind: Kind
    required: bool = False  # read with no fallback: a missing key fails the model load
    choices: tuple[str, ...] = ()


S, B, I, F = Kind.STRING, Kind.BOOL, Kind.INT, Kind.FLOAT  # noqa: E741

# Every key model_state.cc and model_instance_state.cc read.
PARAMETERS: dict[str, Param] = {
    "gpt_model_type": Param(Kind.CHOICE, required=True, choices=GPT_MODEL_TYPES),
    "tokenizer_dir": Param(S, required=True),
    "xgrammar_tokenizer_info_path": Param(S, required=True),
    "guided_decoding_backend": Param(S, required=True),
    "gpt_model_path": Param(S),
    "encoder_model_path": Param(S),
    "executor_worker_path": Param(S),
    "gpu_device_ids": Param(S),
    "participant_ids": Param(S),
    "max_beam_width": Param(I),
    "batch_scheduler_policy": Param(Kind.CHOICE, choices=BATCH_SCHEDULER_POLICIES),
    "decoding_mode": Param(Kind.CHOICE, choices=DECODING_MODES),
    "kv_cache_free_gpu_mem_fraction": Param(F),
    "cross_kv_cache_fraction": Param(F),
    "max_tokens_in_paged_kv_cache": Param(I),
    "kv_cache_host_memory_bytes": Param(I),
    "kv_cache_onboard_blocks": Param(B),
    "max_attention_window_size": Param(S),
    "sink_token_length": Param(I),
    "enable_kv_cache_reuse": Param(B),
    "enable_chunked_context": Param(B),
    "exclude_input_in_output": Param(B),
    "normalize_log_probs": Param(B),
    "enable_trt_overlap": Param(B),
    "multi_block_mode": Param(B),
    "enable_context_fmha_fp32_acc": Param(B),
    "cuda_graph_mode": Param(B),
    "cuda_graph_cache_size": Param(I),
    "speculative_decoding_fast_logits": Param(B),
    "medusa_choices": Param(S),
    "eagle_choices": Param(S),
    "lookahead_window_size": Param(I),
    "lookahead_ngram_size": Param(I),
    "lookahead_verification_set_size": Param(I),
    "gpu_weights_percent": Param(F),
    "iter_stats_max_iterations": Param(I),
    "request_stats_max_iterations": Param(I),
    "recv_poll_period_ms": Param(I),
    "cancellation_check_period_ms": Param(I),
    "stats_check_period_ms": Param(I),
    "num_nodes": Param(I),
    "lora_cache_max_adapter_size": Param(I),
    "lora_cache_optimal_adapter_size": Param(I),
    "lora_cache_gpu_memory_fraction": Param(F),
    "lora_cache_host_memory_bytes": Param(I),
    "lora_prefetch_dir": Param(S),
    # The stock template's python-backend switch; the C++ backend never reads it.
    "FORCE_CPU_ONLY_INPUT_TENSORS": Param(S),
}

# Settings that break the (1+K)-row prompt table or MRoPE (TensorRT-LLM cpp/tensorrt_llm/kernels/
# unfusedAttentionKernels and batch_manager/promptTuningBuffers.cpp): sink tokens
# (StreamingLLM) send attention through the rope kernel that ignores the MRoPE table, and
# prompt-table offloading copies one row per fake id, dropping the DeepStack rows. The 1.2
# backend does not read `prompt_table_offloading`; a later one may, so it is refused too.
_GUARDS = {
    "sink_token_length": "sink tokens (StreamingLLM) rotate with the rope kernel that ignores "
                         "the MRoPE table",
    "prompt_table_offloading": "prompt-table offloading copies one row per fake id and drops "
                               "the DeepStack rows",
}


def parse_bool(text: str) -> bool | None:
    """The backend's bool, or None where it would fail ("Cannot convert X to a boolean")."""
    return True if text in TRUE else False if text in FALSE else None


def parse_int(text: str) -> int | None:
    """A whole int32 (std::stoi would also take a numeric prefix: "12abc" -> 12)."""
    if not _INT.fullmatch(text.strip()):
        return None
    value = int(text)
    return value if -(2**31) <= value < 2**31 else None


def parse_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def executor_max_input_len(*, max_seq_len: int, max_num_tokens: int,
                           chunked_context: bool) -> int:
    """The longest prompt the TensorRT-LLM executor takes (it refuses a longer one with
    "Prompt length (N) exceeds maximum input length (M)"), as TrtGptModel's constructor sets
    it (cpp/tensorrt_llm/batch_manager/trtGptModel.h): max_seq_len - 1 with chunked
    context, else min(max_seq_len - 1, max_num_tokens), since our engines always have
    context FMHA and packed input (the build's max_input_len counts only without them)."""
    if chunked_context:
        return max_seq_len - 1
    return min(max_seq_len - 1, max_num_tokens)


# The executor's warning when it turns enable_chunked_context off (executorImpl.cpp).
CHUNKING_DISABLED = "Chunked context is not supported for this configuration and will be disabled"


@dataclass(frozen=True)
class EngineLimits:
    """What the executor reads of an engine's build_config (config.json, as TensorRT-LLM's
    Engine.save writes it; the keys of its BuildConfig and PluginConfig) for a request's
    context phase. The backend passes no max_num_tokens of its own (model_instance_state.cc
    getExecutorConfigFromParams), so the engine's holds."""

    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    paged_context_fmha: bool  # plugin_config.use_paged_context_fmha

    @classmethod
    def of_build_config(cls, build: Mapping[str, Any]) -> EngineLimits:
        plugins = build.get("plugin_config", {})
        return cls(max_seq_len=build.get("max_seq_len", 0),
                   max_num_tokens=build.get("max_num_tokens", 0),
                   tokens_per_block=plugins.get("tokens_per_block", 0),
                   paged_context_fmha=plugins.get("use_paged_context_fmha") is True)

    def chunked(self, enable_chunked_context: bool) -> bool:
        """Whether the executor chunks long contexts: on an engine without paged context FMHA
        it turns enable_chunked_context off with a warning (CHUNKING_DISABLED) instead of
        failing the load (executorImpl.cpp createModel: executorConfigIsValid /
        fixExecutorConfig)."""
        return enable_chunked_context and self.paged_context_fmha

    def max_input_len(self, enable_chunked_context: bool) -> int:
        return executor_max_input_len(max_seq_len=self.max_seq_len,
                                      max_num_tokens=self.max_num_tokens,
                                      chunked_context=self.chunked(enable_chunked_context))

    @property
    def context_chunk(self) -> int:
        """The chunk a context longer than max_num_tokens runs in when it has a step to
        itself: max_num_tokens rounded down to whole KV blocks. The first-come-first-served
        policy cuts a context that does not fit to a multiple of the chunk unit
        (cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp setCtxRequestsChunkSize),
        and the unit its scheduler gets is tokens_per_block (trtGptModelInflightBatching.cpp
        constructor: the unit is lowered to max_num_tokens only after the scheduler took its
        copy). Beside decodes the step has fewer tokens left and chunks are smaller."""
        return self.max_num_tokens // self.tokens_per_block * self.tokens_per_block

    def chunking_problem(self) -> str | None:
        """Why chunked context could not serve a long prompt on this engine (None: it can):
        no check at load upstream, but with max_num_tokens below one block every chunk rounds
        down to 0 tokens and such a prompt is never scheduled."""
        if self.context_chunk > 0:
            return None
        return (f"max_num_tokens {self.max_num_tokens} is below one KV block "
                f"(tokens_per_block {self.tokens_per_block}): the executor cuts chunks to whole "
                "blocks, so a prompt longer than max_num_tokens would never be scheduled; "
                "rebuild the engine with max_num_tokens of at least one block")


def check_parameters(params: Mapping[str, str]) -> list[str]:
    """Problems of a tensorrtllm model's parameters (key -> string_value), each naming the
    key and the fix; empty when the backend loads them as written."""
    problems = []
    for key, spec in PARAMETERS.items():
        if spec.required and key not in params:
            problems.append(f"parameter {key} is missing: the backend reads it with no "
                            "fallback and fails the load (an empty string means not set)")
    for key, text in params.items():
        spec = PARAMETERS.get(key)
        if key in _GUARDS:
            if text.strip() not in ("", *FALSE):
                problems.append(f"parameter {key} is {text!r}: {_GUARDS[key]}; remove it")
            continue
        if key == "worker_path":
            problems.append("parameter worker_path is no longer supported by the backend "
                            "(it throws); use executor_worker_path")
        elif spec is None:
            problems.append(f"parameter {key} is not read by the tensorrtllm backend (a "
                            "misspelling?); remove or correct it")
        elif spec.kind is Kind.BOOL and parse_bool(text) is None:
            problems.append(f"parameter {key} is {text!r}: the backend's booleans are "
                            f"{'/'.join(TRUE)} and {'/'.join(FALSE)}")
        elif spec.kind is Kind.INT and parse_int(text) is None:
            problems.append(f"parameter {key} is {text!r}, not a whole number")
        elif spec.kind is Kind.FLOAT and parse_float(text) is None:
            problems.append(f"parameter {key} is {text!r}, not a number")
        elif spec.kind is Kind.CHOICE and text not in spec.choices:
            problems.append(f"parameter {key} is {text!r}; choose one of "
                            f"{', '.join(spec.choices)} (the backend would "
                            f"{'fail the load' if spec.required else 'use its default'})")
    problems += _guided_decoding_problems(params)
    return problems


def _guided_decoding_problems(params: Mapping[str, str]) -> list[str]:
    """Guided decoding is on when both the backend and the tokenizer info path are set; then
    the backend must be xgrammar (else it throws)."""
    backend = params.get("guided_decoding_backend", "")
    info = params.get("xgrammar_tokenizer_info_path", "")
    if backend and info and backend != "xgrammar":
        return [f"parameter guided_decoding_backend is {backend!r}: the backend supports only "
                "xgrammar (or empty: off)"]
    return []


# ---- the backend's metrics ---------------------------------------------------------------
# What the backend publishes on Triton's /metrics (TensorRT-LLM 1.2 triton_backend
# inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc
# InitializeReporter): families of gauges, each series labelled model, version and the
# family's category label. model_instance_state.cc WaitForStats sets them every
# stats_check_period_ms from the executor's latest iteration stats (so after the last
# iteration they keep its values): active = numActiveRequests (the requests in the batch,
# at most max_batch_size: executorImpl.cpp), max = maxNumActiveRequests, scheduled and
# context from the inflight batching stats, waiting = active - scheduled (not the executor's
# queue, which no metric shows), iteration_counter = the iteration's number. At each
# request's final response (reportCustomMetrics) its input and output token counts go into
# two histograms with the buckets below. The KV cache group comes from the iteration's
# kvCacheStats: max, free, used and reused blocks, tokens per block, and fraction = used / max
# (0 while max is 0). The reference tensorrt_llm publishes the same
# (runtime/reference_tensorrt_llm.py); serve reads iteration_counter as the engine's
# progress (serve/progress.py).

@dataclass(frozen=True)
class MetricGroup:
    family: str
    category: str  # the label naming the series within the family
    series: tuple[str, ...]


REQUEST_METRICS = MetricGroup("nv_trt_llm_request_metrics", "request_type",
                              ("active", "max", "scheduled", "context", "waiting"))
KV_CACHE_METRICS = MetricGroup("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type",
                               ("max", "free", "used", "tokens_per", "reused", "fraction"))
INFLIGHT_BATCHER_METRICS = MetricGroup(
    "nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric",
    ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"))
GENERAL_METRICS = MetricGroup("nv_trt_llm_general_metrics", "general_type",
                              ("timestamp", "iteration_counter"))
OUTPUT_TOKEN_LEN = MetricGroup("nv_llm_output_token_len", "response_metric_type",
                               ("total_output_tokens",))
INPUT_TOKEN_LEN = MetricGroup("nv_llm_input_token_len", "response_metric_type",
                              ("total_input_tokens",))
TOKEN_LEN_BUCKETS = (10.0, 50.0, 100.0, 500.0, 1000.0)
ITERATION_COUNTER = "iteration_counter"
