"""Memory and capacity planner for a (checkpoint, GPU profile) pair.

Figures are for the FP16 engines this tool builds. Weights and the KV cache are exact from
the config; activation workspaces are estimates (stated as such) from the profile's limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

from .checkpoint import TEMPORAL_PATCH_SIZE, Checkpoint
from .errors import PlanError
from .llm.engine import prompt_table_rows
from .mm.geometry import image_token_count, video_token_count
from .profiles import BuildLimits, GpuProfile, load_profile, profile_names

GIB = 1024**3
FP16 = 2
# CUDA context, cuBLAS workspaces and the TensorRT-LLM runtime's own buffers: a measured
# rule of thumb, not derived from the model.
RUNTIME_OVERHEAD_BYTES = 1 * GIB
# The vision engine runs in its own python-backend process: a second CUDA context and the
# TensorRT runtime (its activations are vision_activation_bytes). A rule of thumb as well.
VISION_PROCESS_OVERHEAD_BYTES = GIB // 2
# A gather input above 2^31 elements is unverified in TensorRT (STOCK_BACKEND.md).
MAX_TABLE_ELEMENTS = 2**31

# The requests the capacity lines are stated for: the two workloads users measure, an image
# with a question and a short clip (10 s sampled at 3 fps).
TYPICAL_IMAGE = (1080, 1920)  # height, width
TYPICAL_VIDEO = (30, 720, 1280)  # frames, height, width
TYPICAL_TEXT_TOKENS = 64
TYPICAL_OUTPUT_TOKENS = 512
# Per temporal group of a video the prompt carries "<t.t seconds>" and the vision start/end
# tokens around its pads: with Qwen's tokenizer "<12.5 seconds>" is '<', '1', '2', '.', '5',
# ' seconds', '>', so 9 tokens a group for clips up to 99.9 s (8 below 10 s).
VIDEO_GROUP_TEXT_TOKENS = 9


@dataclass(frozen=True)
class TypicalRequest:
    media: str  # "1920x1080 image" / "30-frame 1280x720 video"
    visual_tokens: int
    text_tokens: int
    output_tokens: int
    kv_tokens: int  # rounded up to whole KV blocks
    # Why the profile refuses it ("" when it is admitted): too many visual tokens for the
    # per-request cap, a prompt above max_input_len, video turned off.
    refused: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens


@dataclass(frozen=True)
class Plan:
    model: str
    variant: str
    profile: str
    limits: BuildLimits
    gpu_memory_bytes: int
    vision_weight_bytes: int
    llm_weight_bytes: int
    vision_activation_bytes: int  # estimate
    llm_activation_bytes: int  # estimate
    runtime_overhead_bytes: int  # TensorRT-LLM process + vision process
    prompt_table_rows: int  # max_prompt_embedding_table_size
    prompt_table_rows_per_request: int  # the runtime's cap: rows / max_batch_size
    prompt_table_elements: int  # rows x hidden_size
    prompt_table_bytes: int
    # Bytes PromptTuningBuffers::fill copies into the slots on every step (context and
    # generation) with every slot holding a request at the cap: device to device, each
    # request's table having been moved to the GPU once at its context step.
    prompt_table_copy_bytes_per_step: int
    mrope_table_bytes_per_request: int
    mrope_table_bytes: int
    # /dev/shm the python backend needs with a full batch of requests at the caps in flight:
    # each request's 8-bit pixels and its int64 MRoPE position ids cross it twice (out of
    # preprocessing, into vision_encoder / the LLM's caller), its prompt table three times
    # (out of vision_encoder, into the caller, into tensorrt_llm by BLS) and the MRoPE table
    # once (built by the caller, into tensorrt_llm). Not GPU memory.
    shm_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    # The build's deterministic KV budget alone on the card, for the backend's
    # max_tokens_in_paged_kv_cache: kv_cache_free_gpu_mem_fraction of what fixed_bytes leave,
    # in whole blocks. See repository_kv_budgets for why it is load-order proof.
    kv_capacity_tokens: int
    typical_request: TypicalRequest
    concurrent_typical_requests: int
    typical_video: TypicalRequest
    # Typical videos the KV cache holds at once (batch slots bound it too); 0 if refused.
    concurrent_typical_videos: int
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def resident_bytes(self) -> int:
        """What the build holds on the card while serving: fixed buffers plus its KV cache."""
        return self.fixed_bytes + self.kv_cache_bytes

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
            f"{plan.gpu_memory_bytes / GIB:.1f} GiB on {profile.name}: use a smaller checkpoint "
            "or a card with more memory, or lower limits.max_batch_size and "
            "limits.max_visual_tokens_per_request (prompt table) and limits.max_num_tokens "
            "(activations)"
        )
    elif plan.prompt_table_elements >= MAX_TABLE_ELEMENTS:
        problems.append(
            f"the prompt table holds {plan.prompt_table_elements:,} elements, at or above "
            f"2^31 where TensorRT gathers are unverified: lower "
            "limits.max_visual_tokens_per_request or limits.max_batch_size"
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
            f"({plan.typical_request.media}, {plan.typical_request.kv_tokens} tokens), "
            f"fewer than limits.max_batch_size ({lim.max_batch_size}): {fix}, or lower "
            "limits.vision_max_pixels"
        )
    return replace(plan, problems=tuple(problems))


def plan_every_profile(ckpt: Checkpoint) -> list[tuple[GpuProfile, Plan]]:
    """The checkpoint against every shipped profile, in profile_names() order: the table a
    platform engineer picks a card from."""
    profiles = [load_profile(name) for name in profile_names()]
    return [(p, make_plan(ckpt, p)) for p in profiles]


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
    rows = prompt_table_rows(lim, v.deepstack_count)
    row_bytes = t.hidden_size * FP16
    # (cos, sin) per position and frequency, fp32, positions bounded by max_seq_len.
    mrope_per_request = lim.max_seq_len * t.head_dim * 4
    plan = Plan(
        model=str(ckpt.path),
        variant=ckpt.variant,
        profile=profile.name,
        limits=lim,
        gpu_memory_bytes=profile.memory_bytes,
        vision_weight_bytes=params["vision"] * FP16,
        llm_weight_bytes=(params["llm"] + lm_head_copy) * FP16,
        vision_activation_bytes=vision_act,
        llm_activation_bytes=llm_act,
        runtime_overhead_bytes=RUNTIME_OVERHEAD_BYTES + VISION_PROCESS_OVERHEAD_BYTES,
        prompt_table_rows=rows,
        prompt_table_rows_per_request=rows // lim.max_batch_size,
        prompt_table_elements=rows * t.hidden_size,
        prompt_table_bytes=rows * row_bytes,
        prompt_table_copy_bytes_per_step=lim.max_batch_size
        * (rows // lim.max_batch_size) * row_bytes,
        mrope_table_bytes_per_request=mrope_per_request,
        mrope_table_bytes=mrope_per_request * lim.max_batch_size,
        shm_bytes=lim.max_batch_size * (
            2 * lim.max_visual_tokens_per_request * v.spatial_merge_size**2 * v.patch_dim
            + 2 * 3 * lim.max_input_len * 8
            + mrope_per_request + 3 * (rows // lim.max_batch_size) * row_bytes),
        kv_bytes_per_token=t.kv_bytes_per_token_fp16,
        kv_cache_bytes=0,
        kv_capacity_tokens=0,
        typical_request=_typical_request(profile),
        concurrent_typical_requests=0,
        typical_video=_typical_video(profile),
        concurrent_typical_videos=0,
        problems=(),
    )
    kv_bytes = _kv_shares([plan])[0]
    capacity = _whole_blocks(kv_bytes, plan)
    video = plan.typical_video
    return replace(
        plan,
        kv_cache_bytes=kv_bytes,
        kv_capacity_tokens=capacity,
        concurrent_typical_requests=capacity // plan.typical_request.kv_tokens,
        concurrent_typical_videos=0 if video.refused
        else min(capacity // video.kv_tokens, lim.max_batch_size),
    )


def repository_kv_budgets(plans: Sequence[Plan]) -> tuple[int, ...]:
    """max_tokens_in_paged_kv_cache for each build when one tritonserver serves them all on
    one GPU.

    The tensorrtllm backend passes both max_tokens_in_paged_kv_cache and
    kv_cache_free_gpu_mem_fraction to the executor's KvCacheConfig, and the KV cache manager
    takes the smaller of the two (TensorRT-LLM cpp/tensorrt_llm/batch_manager/
    kvCacheManager.cpp: BaseKVCacheManager::calculateMaxNumBlocks, `std::min(maxTokensFromConfig,
    maxTokens)`; calculateFreeMemBytes warns "The smaller value will be used"). The fraction
    applies to the memory free when that model loads, which depends on what Triton happened
    to load first; max_tokens does not. So the budgets are sized to stay the smaller value in
    every load order, which makes them the ones the executor uses.

    Design: every build's fixed_bytes (weights, activations, prompt table, MRoPE tables,
    runtime overhead) stay resident; of what is left, R, the KV caches get f x R together
    (f: the smallest kv_cache_free_gpu_mem_fraction among the builds, so the profile's
    headroom is kept), split in proportion to each build's full-batch demand w_i
    (max_batch_size x max_seq_len x KV bytes per token). In the worst load order build i
    loads last and sees f_i x (R - f x (1 - w_i) x R) >= f x w_i x R of fraction-derived
    cache, since f <= f_i and w_i <= 1: its max_tokens stays the smaller value. One build
    alone gets f x R, the budget make_plan reports. Budgets are whole KV blocks.

    Raises PlanError when the builds plan for cards of different sizes, or when the fixed
    bytes leave no room or some build gets less than one max_seq_len sequence.
    """
    if not plans:
        return ()
    names = ", ".join(_build_name(p) for p in plans)
    if len({p.gpu_memory_bytes for p in plans}) > 1:
        raise PlanError(
            f"builds {names} plan for GPUs of different memory sizes; serve builds that share "
            "a GPU from profiles of that one card"
        )
    shares = _kv_shares(plans)
    budgets = tuple(_whole_blocks(b, p) for b, p in zip(shares, plans, strict=True))
    short = [p for p, tokens in zip(plans, budgets, strict=True) if tokens < p.limits.max_seq_len]
    if short:
        fixed = sum(p.fixed_bytes for p in plans)
        raise PlanError(
            f"builds {names} do not fit together on one "
            f"{plans[0].gpu_memory_bytes / GIB:g} GiB GPU: their weights and buffers take "
            f"{fixed / GIB:.1f} GiB and {_build_name(short[0])} is left less KV cache than one "
            f"limits.max_seq_len sequence; serve them on separate GPUs or lower "
            "limits.max_batch_size and limits.max_seq_len"
        )
    return budgets


def _kv_shares(plans: Sequence[Plan]) -> list[int]:
    """Bytes of KV cache per build; see repository_kv_budgets."""
    left = plans[0].gpu_memory_bytes - sum(p.fixed_bytes for p in plans)
    if left <= 0:
        return [0] * len(plans)
    demand = [p.limits.max_batch_size * p.limits.max_seq_len * p.kv_bytes_per_token
              for p in plans]
    # Exact arithmetic: one build alone gets exactly floor(f x left).
    f = min(Fraction(p.limits.kv_cache_free_gpu_mem_fraction) for p in plans)
    return [math.floor(f * left * d / sum(demand)) for d in demand]


def _whole_blocks(kv_bytes: int, plan: Plan) -> int:
    block = plan.limits.tokens_per_block
    return kv_bytes // plan.kv_bytes_per_token // block * block


def _build_name(plan: Plan) -> str:
    return f"{Path(plan.model).name} ({plan.variant}, {plan.profile})"


def _typical_request(profile: GpuProfile) -> TypicalRequest:
    lim = profile.limits
    h, w = TYPICAL_IMAGE
    image_tokens = image_token_count(
        h, w, min_pixels=lim.vision_min_pixels, max_pixels=lim.vision_max_pixels
    )
    return _typical(lim, f"{w}x{h} image", image_tokens, TYPICAL_TEXT_TOKENS, "")


def _typical_video(profile: GpuProfile) -> TypicalRequest:
    """The clip as the profile admits it: its frames scaled into the video budget."""
    lim = profile.limits
    frames, h, w = TYPICAL_VIDEO
    media = f"{frames}-frame {w}x{h} video"
    groups = -(-frames // TEMPORAL_PATCH_SIZE)
    text = TYPICAL_TEXT_TOKENS + groups * VIDEO_GROUP_TEXT_TOKENS
    if not lim.max_videos_per_request:
        return _typical(lim, media, 0, text, "limits.max_videos_per_request is 0")
    # Any frame minimum is far below a 1280x720 clip's: min_pixels does not bind.
    tokens = video_token_count(frames, h, w, min_pixels=0, max_pixels=lim.video_max_pixels,
                               max_pixels_per_frame=lim.video_max_pixels_per_frame)
    refused = ""
    if frames > lim.video_max_frames:
        refused = f"{frames} frames, above limits.video_max_frames ({lim.video_max_frames})"
    elif tokens > lim.max_visual_tokens_per_request:
        refused = (f"{tokens} visual tokens, above limits.max_visual_tokens_per_request "
                   f"({lim.max_visual_tokens_per_request})")
    elif tokens + text > lim.max_input_len:
        refused = (f"a {tokens + text}-token prompt, above limits.max_input_len "
                   f"({lim.max_input_len})")
    return _typical(lim, media, tokens, text, refused)


def _typical(lim: BuildLimits, media: str, visual: int, text: int, refused: str) \
        -> TypicalRequest:
    total = visual + text + TYPICAL_OUTPUT_TOKENS
    kv_tokens = math.ceil(total / lim.tokens_per_block) * lim.tokens_per_block
    return TypicalRequest(media, visual, text, TYPICAL_OUTPUT_TOKENS, kv_tokens, refused)


def _largest_batch_that_fits(ckpt: Checkpoint, profile: GpuProfile) -> int:
    """The largest max_batch_size whose KV cache holds that many typical requests."""
    for batch in range(profile.limits.max_batch_size - 1, 0, -1):
        smaller = replace(profile, limits=replace(profile.limits, max_batch_size=batch))
        if _figures(ckpt, smaller).concurrent_typical_requests >= batch:
            return batch
    return 0
