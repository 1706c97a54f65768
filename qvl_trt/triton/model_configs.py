"""The config.pbtxt of every model of one build in the repository, as protobufs.

Everything a config holds comes from `StepSettings` (the GPU profile's limits, the built
engines, the flavor), so the files never carry a "${...}" placeholder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..llm.guided import BACKEND as GUIDED_DECODING_BACKEND
from ..mm.rope import MropeTable
from . import contract as c
from .contract import PostprocessingParameters, TensorrtLlmBlsParameters
from .options import Flavor
from .pbconfig import add_inputs, add_outputs, new_config, pb2, set_parameters

# Where the TensorRT-LLM container installs the executor worker (orchestrator mode).
EXECUTOR_WORKER_PATH = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
# How often tensorrt_llm polls its requests for a client's cancel: the stock backend's
# parameter, and the reference model's (an ask is a round trip to Triton there).
CANCELLATION_CHECK_PERIOD_MS = 100
# Prefill long multimodal prompts in chunks beside running decodes (the stock backend's
# enable_chunked_context, and the reference model's parameter of that name); it also sets the
# longest prompt the executor takes (tensorrtllm_backend.EngineLimits.max_input_len).
ENABLE_CHUNKED_CONTEXT = True
# Reuse the KV blocks of a prompt's prefix (the stock backend's enable_kv_cache_reuse, and the
# reference model's parameter of that name). Safe with images and across tenants: every
# prompt_table_extra_id carries the image's hash within the request's cache scope
# (mm/prompt_table.py), so blocks of one image or one scope are never reused for another.
ENABLE_KV_CACHE_REUSE = True


@dataclass(frozen=True)
class StepSettings:
    names: c.ModelNames
    flavor: Flavor
    max_batch_size: int
    hidden_size: int
    patch_dim: int
    table_dtype: str  # contract type of prompt_embedding_table: the LLM engine's dtype
    mrope: MropeTable  # the MRoPE table the LLM's callers build
    # tensorrt_llm backend (trt flavor)
    engine_dir: str = ""
    kv_cache_free_gpu_mem_fraction: float = 0.9
    # The planner's KV budget: the backend takes the smaller of this and the fraction of the
    # memory free when it loads, so the vision engine loading beside it cannot race it.
    max_tokens_in_paged_kv_cache: int = 0
    batch_scheduler_policy: str = "guaranteed_no_evict"
    # xgrammar's tokenizer info file as the backend opens it (absolute, like engine_dir)
    tokenizer_info_path: str = ""
    # python models' parameters (read by their model.py), by step; postprocessing's and
    # tensorrt_llm_bls's come from the names and the batch
    parameters: Mapping[str, c.ModelParameters] = field(default_factory=dict)
    preprocessing_instances: int = 2
    # postprocessing and tensorrt_llm_bls: each instance reads and sends tokens on its own
    # stub (RepoOptions.postprocessing_instances says why several).
    postprocessing_instances: int = 1
    # Requests that may wait for one of tensorrt_llm's batch slots, and for how long
    # (RepoOptions.max_queue, max_queue_wait_s).
    max_queue: int = 0
    max_queue_wait_s: float = 0.0


def step_configs(s: StepSettings) -> dict[str, Any]:
    """Model name -> ModelConfig for the six models of one build."""
    n = s.names
    return {
        n.preprocessing: preprocessing_config(s),
        n.vision_encoder: vision_encoder_config(s),
        n.tensorrt_llm: tensorrt_llm_config(s),
        n.postprocessing: postprocessing_config(s),
        n.tensorrt_llm_bls: tensorrt_llm_bls_config(s),
        n.ensemble: ensemble_config(s),
    }


def _python_model(s: StepSettings, name: str, step: str, *, instances: int = 1,
                  decoupled: bool = False) -> Any:
    config = new_config(name, backend="python", max_batch_size=s.max_batch_size)
    # KIND_CPU: the model picks its device itself, so the same repository loads on a machine
    # without GPUs (reference flavor) and Triton does not pin one instance per GPU.
    config.instance_group.add(count=instances, kind=pb_kind("KIND_CPU"))
    if decoupled:
        config.model_transaction_policy.decoupled = True
    if step in s.parameters:
        set_parameters(config, s.parameters[step].to_parameters())
    return config


def pb_kind(name: str) -> int:
    return pb2().ModelInstanceGroup.Kind.Value(name)


def _specialise(specs: tuple[c.TensorSpec, ...], s: StepSettings) -> list[c.TensorSpec]:
    """Contract specs with the build's dims and prompt-table dtype filled in."""
    out = []
    for spec in specs:
        if spec.name == c.PROMPT_EMBEDDING_TABLE:
            spec = dataclasses.replace(spec, data_type=s.table_dtype,
                                       dims=(-1, s.hidden_size))
        elif spec.name == c.PIXEL_VALUES:
            spec = dataclasses.replace(spec, dims=(-1, s.patch_dim))
        out.append(spec)
    return out


def preprocessing_config(s: StepSettings) -> Any:
    config = _python_model(s, s.names.preprocessing, c.PREPROCESSING,
                           instances=s.preprocessing_instances)
    add_inputs(config, _specialise(c.PREPROCESSING_INPUTS, s))
    add_outputs(config, _specialise(c.PREPROCESSING_OUTPUTS, s))
    return config


def vision_encoder_config(s: StepSettings) -> Any:
    config = _python_model(s, s.names.vision_encoder, c.VISION_ENCODER)
    add_inputs(config, _specialise(c.VISION_INPUTS, s))
    add_outputs(config, _specialise(c.VISION_OUTPUTS, s))
    return config


def tensorrt_llm_config(s: StepSettings) -> Any:
    if s.flavor is Flavor.REFERENCE:
        # Same I/O as the stock backend; decoupled so it streams like it.
        config = _python_model(s, s.names.tensorrt_llm, c.TENSORRT_LLM, decoupled=True)
    else:
        config = new_config(s.names.tensorrt_llm, backend="tensorrtllm",
                            max_batch_size=s.max_batch_size)
        config.model_transaction_policy.decoupled = True
        config.dynamic_batching.preferred_batch_size.append(s.max_batch_size)
        # The backend places work on the GPUs itself: one CPU instance.
        config.instance_group.add(count=1, kind=pb_kind("KIND_CPU"))
        set_parameters(config, trtllm_parameters(s))
    add_inputs(config, _specialise(c.LLM_INPUTS, s))
    add_outputs(config, c.LLM_OUTPUTS)
    return config


def trtllm_parameters(s: StepSettings) -> dict[str, str | int | float | bool]:
    """Parameters of the stock tensorrtllm backend (all strings in the config); what it
    reads and how: `tensorrtllm_backend.PARAMETERS`."""
    return {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": s.engine_dir,
        # Read with no fallback (a missing one fails the load); empty means not set. The C++
        # runtime's guided decoding reads the tokenizer info file, not tokenizer_dir.
        "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": s.tokenizer_info_path,
        "guided_decoding_backend": GUIDED_DECODING_BACKEND,
        "max_beam_width": 1,
        "batch_scheduler_policy": s.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": s.kv_cache_free_gpu_mem_fraction,
        "max_tokens_in_paged_kv_cache": s.max_tokens_in_paged_kv_cache,
        "enable_chunked_context": ENABLE_CHUNKED_CONTEXT,
        "enable_kv_cache_reuse": ENABLE_KV_CACHE_REUSE,
        # output_ids then hold only generated tokens, streaming or not.
        "exclude_input_in_output": True,
        "cancellation_check_period_ms": CANCELLATION_CHECK_PERIOD_MS,
        "stats_check_period_ms": 100,
        "executor_worker_path": EXECUTOR_WORKER_PATH,
    }


def postprocessing_config(s: StepSettings) -> Any:
    # Decoupled: it streams text as tensorrt_llm (which it calls) streams tokens. Each request
    # runs in a worker thread of one of its instances.
    config = _python_model(s, s.names.postprocessing, c.POSTPROCESSING,
                           instances=s.postprocessing_instances, decoupled=True)
    set_parameters(config, PostprocessingParameters(
        tensorrt_llm_model=s.names.tensorrt_llm, **_admission(s),
        **PostprocessingParameters.mrope_fields(s.mrope)).to_parameters())
    add_inputs(config, _specialise(c.POSTPROCESSING_INPUTS, s))
    add_outputs(config, c.POSTPROCESSING_OUTPUTS)
    return config


def tensorrt_llm_bls_config(s: StepSettings) -> Any:
    """The ensemble's I/O in one decoupled model that runs the steps by BLS
    (runtime/tensorrt_llm_bls.py), so that a client's cancel reaches it."""
    n = s.names
    config = _python_model(s, n.tensorrt_llm_bls, c.TENSORRT_LLM_BLS,
                           instances=s.postprocessing_instances, decoupled=True)
    set_parameters(config, TensorrtLlmBlsParameters(
        tensorrt_llm_model=n.tensorrt_llm, **_admission(s),
        preprocessing_model=n.preprocessing, vision_encoder_model=n.vision_encoder,
        **PostprocessingParameters.mrope_fields(s.mrope)).to_parameters())
    add_inputs(config, c.ENSEMBLE_INPUTS)
    add_outputs(config, c.ENSEMBLE_OUTPUTS)
    return config


def _admission(s: StepSettings) -> dict[str, Any]:
    """The admission fields of a caller of tensorrt_llm: its batch slots and queue."""
    return {"batch_slots": s.max_batch_size, "max_queue": s.max_queue,
            "max_queue_wait_s": s.max_queue_wait_s}


def ensemble_config(s: StepSettings) -> Any:
    """preprocessing -> vision_encoder -> postprocessing (which runs tensorrt_llm). Step
    outputs go through internal tensors named `_<tensor>`; the public I/O keeps the
    contract names, and postprocessing reads the guide (c.FROM_PUBLIC) from it."""
    n = s.names
    config = new_config(n.ensemble, platform="ensemble", max_batch_size=s.max_batch_size)
    add_inputs(config, c.ENSEMBLE_INPUTS)
    add_outputs(config, c.ENSEMBLE_OUTPUTS)
    public_out = {spec.name for spec in c.ENSEMBLE_OUTPUTS}

    def add_step(model: str, inputs: tuple[c.TensorSpec, ...],
                 outputs: tuple[c.TensorSpec, ...], *, from_public: bool = False) -> None:
        step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        for spec in inputs:
            public = from_public or spec.name in c.FROM_PUBLIC
            step.input_map[spec.name] = spec.name if public else f"_{spec.name}"
        for spec in outputs:
            step.output_map[spec.name] = spec.name if spec.name in public_out else f"_{spec.name}"

    add_step(n.preprocessing, c.PREPROCESSING_INPUTS, c.PREPROCESSING_OUTPUTS,
             from_public=True)
    add_step(n.vision_encoder, c.VISION_INPUTS, c.VISION_OUTPUTS)
    add_step(n.postprocessing, c.POSTPROCESSING_INPUTS, c.POSTPROCESSING_OUTPUTS)
    return config
