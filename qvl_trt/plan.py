"""Memory and capacity planner for a (checkpoint, GPU profile) pair.

Figures are for the FP16 engines this tool builds. Weights and the KV cache are exact from
the config; activation workspaces are estimates (stated as such) from the profile's limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .checkpoint import Checkpoint
from .errors import PlanError
from .mm.geometry import image_token_count
from .profiles import GpuProfile

GIB = 1024**3
FP16 = 2
# CUDA context, cuBLAS workspaces and the TensorRT-LLM runtime's own buffers: a measured
# rule of thumb, not derived from the model.
RUNTIME_OVERHEAD_BYTES = 1 * GIB

# The request the capacity line is stated for.
TYPICAL_IMAGE = (1080, 1920)  # height, width
TYPICAL_TEXT_TOKENS = 64
TYPICAL_OUTPUT_TOKENS = 512


@dataclass(frozen=True)
class TypicalRequest:
    image: str
    image_tokens: int
    text_tokens: int
    output_tokens: int
    kv_tokens: int  # rounded up to whole KV blocks


@dataclass(frozen=True)
class Plan:
    model: str
    variant: str
    profile: str
    gpu_memory_bytes: int
    vision_weight_bytes: int
    llm_weight_bytes: int
    vision_activation_bytes: int  # estimate
    llm_activation_bytes: int  # estimate
    runtime_overhead_bytes: int
    prompt_table_rows: int
    prompt_table_bytes: int
    mrope_table_bytes_per_request: int
    mrope_table_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_capacity_tokens: int
    typical_request: TypicalRequest
    concurrent_typical_requests: int
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def fixed_bytes(self) -> int:
        """Everything resident before the KV cache is carved out."""
        return (
            self.vision_weight_bytes
            + self.llm_weight_bytes
            + self.vision_activation_bytes
            + self.llm_activation_bytes
            + self.runtime_overhead_bytes
            + self.prompt_table_bytes
            + self.mrope_table_bytes
        )


def make_plan(ckpt: Checkpoint, profile: GpuProfile) -> Plan:
    """Compute the plan; `problems` lists every reason the pair cannot work, with the fix."""
    plan = _figures(ckpt, profile)
    problems = []
    lim = profile.limits
    free = plan.gpu_memory_bytes - plan.fixed_bytes
    if free <= 0:
        problems.append(
            f"weights and buffers need {plan.fixed_bytes / GIB:.1f} GiB of the "
            f"{profile.gpu.memory_gib:g} GiB on {profile.name}: use a smaller checkpoint or a "
            "card with more memory, or lower limits.max_batch_size (prompt table) and "
            "limits.max_num_tokens (activations)"
        )
    elif plan.kv_capacity_tokens < lim.max_seq_len:
        problems.append(
            f"the KV cache holds {plan.kv_capacity_tokens} tokens, less than one request of "
            f"limits.max_seq_len ({lim.max_seq_len}): lower limits.max_seq_len or "
            "limits.max_batch_size, or use a card with more memory"
        )
    elif plan.concurrent_typical_requests < lim.max_batch_size:
        best = _largest_batch_that_fits(ckpt, profile)
        fix = f"lower limits.max_batch_size to {best}" if best else "use a card with more memory"
        problems.append(
            f"the KV cache holds {plan.concurrent_typical_requests} concurrent typical requests "
            f"({plan.typical_request.image} image, {plan.typical_request.kv_tokens} tokens), "
            f"fewer than limits.max_batch_size ({lim.max_batch_size}): {fix}, or lower "
            "limits.vision_max_pixels"
        )
    return replace(plan, problems=tuple(problems))


def check_fits(plan: Plan) -> None:
    """Raise PlanError with the first problem (the one-line message the CLI prints)."""
    if plan.problems:
        raise PlanError(
            f"{plan.variant} checkpoint does not fit profile {plan.profile}: {plan.problems[0]}"
        )


def _figures(ckpt: Checkpoint, profile: GpuProfile) -> Plan:
    t, v, lim = ckpt.text, ckpt.vision, profile.limits
    params = ckpt.param_counts()
    # The TensorRT-LLM engine keeps lm_head apart from the embedding even when HF ties them.
    lm_head_copy = t.vocab_size * t.hidden_size if t.tie_word_embeddings else 0
    max_patches = lim.vision_max_pixels // (v.patch_size**2)
    vision_act = max_patches * (6 * v.hidden_size + 2 * v.intermediate_size) * FP16
    qkv = (t.num_heads + 2 * t.num_kv_heads) * t.head_dim
    llm_act = (
        lim.max_num_tokens * (qkv + 3 * t.hidden_size + 2 * t.intermediate_size) * FP16
        + lim.max_batch_size * t.vocab_size * 4
    )  # fp32 logits of the last tokens
    rows = lim.max_batch_size * (1 + v.deepstack_count) * lim.max_visual_tokens
    # (cos, sin) per position and frequency, fp32, positions bounded by max_seq_len.
    mrope_per_request = lim.max_seq_len * t.head_dim * 4
    kv_per_token = t.kv_bytes_per_token_fp16
    plan = Plan(
        model=str(ckpt.path),
        variant=ckpt.variant,
        profile=profile.name,
        gpu_memory_bytes=int(profile.gpu.memory_gib * GIB),
        vision_weight_bytes=params["vision"] * FP16,
        llm_weight_bytes=(params["llm"] + lm_head_copy) * FP16,
        vision_activation_bytes=vision_act,
        llm_activation_bytes=llm_act,
        runtime_overhead_bytes=RUNTIME_OVERHEAD_BYTES,
        prompt_table_rows=rows,
        prompt_table_bytes=rows * t.hidden_size * FP16,
        mrope_table_bytes_per_request=mrope_per_request,
        mrope_table_bytes=mrope_per_request * lim.max_batch_size,
        kv_bytes_per_token=kv_per_token,
        kv_cache_bytes=0,
        kv_capacity_tokens=0,
        typical_request=_typical_request(profile),
        concurrent_typical_requests=0,
        problems=(),
    )
    kv_bytes = max(
        0, int((plan.gpu_memory_bytes - plan.fixed_bytes) * lim.kv_cache_free_gpu_mem_fraction)
    )
    capacity = kv_bytes // kv_per_token // lim.tokens_per_block * lim.tokens_per_block
    return replace(
        plan,
        kv_cache_bytes=kv_bytes,
        kv_capacity_tokens=capacity,
        concurrent_typical_requests=capacity // plan.typical_request.kv_tokens,
    )


def _typical_request(profile: GpuProfile) -> TypicalRequest:
    lim = profile.limits
    h, w = TYPICAL_IMAGE
    image_tokens = image_token_count(
        h, w, min_pixels=lim.vision_min_pixels, max_pixels=lim.vision_max_pixels
    )
    total = image_tokens + TYPICAL_TEXT_TOKENS + TYPICAL_OUTPUT_TOKENS
    kv_tokens = math.ceil(total / lim.tokens_per_block) * lim.tokens_per_block
    return TypicalRequest(
        f"{w}x{h}", image_tokens, TYPICAL_TEXT_TOKENS, TYPICAL_OUTPUT_TOKENS, kv_tokens
    )


def _largest_batch_that_fits(ckpt: Checkpoint, profile: GpuProfile) -> int:
    """The largest max_batch_size whose KV cache holds that many typical requests."""
    for batch in range(profile.limits.max_batch_size - 1, 0, -1):
        smaller = replace(profile, limits=replace(profile.limits, max_batch_size=batch))
        if _figures(ckpt, smaller).concurrent_typical_requests >= batch:
            return batch
    return 0
