"""Memory and capacity planner for a (checkpoint, GPU profile, weight precision) triple, and
for several builds sharing one card.

Figures are for the engines this tool builds: FP16, the language model's linear layers
optionally weight-only INT8/INT4. Weights and the KV cache are exact from the config;
activation workspaces are estimates (stated as such) from the limits.

With tensor parallelism (TP N) each rank runs on its own card of the profile, and the plan is
for the most loaded one: rank 0's, which holds its share of the language model, its KV cache
and buffers, and the whole vision model. The repository's vision_encoder is a KIND_CPU python
model on the process's current CUDA device, device 0 (qvl_trt/vision/runner.py), which is
also TensorRT-LLM rank 0's: ranks take devices in order unless gpu_device_ids says otherwise.
Every rank sizes its KV cache from its own card, and the ranks then take the smallest of their
token counts (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, calculateMaxNumBlocks:
an allreduce MIN of maxTokens), so rank 0's budget is the one that binds.

A profile's limits are upper bounds: when a checkpoint does not fit them, the planner lowers
them in one documented order (LOWERED_LIMITS, docs/build.md "Per-variant limits") to the
largest that fit, and the build uses what the plan derived.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from pathlib import Path

from .atomic import staged_file
from .checkpoint import (
    PIXELS_PER_IMAGE_TOKEN,
    PIXELS_PER_VIDEO_TOKEN,
    TEMPORAL_PATCH_SIZE,
    VISION_PREFIX,
    Checkpoint,
    TextDims,
    VisionDims,
    expected_shapes,
)
from .dtypes import LLM_ENGINE_DTYPE, WeightOnly
from .errors import PlanError
from .llm.engine import (
    TABLE_ELEMENT_LIMIT,
    engine_build_config,
    prompt_table_element_bound,
    prompt_table_rows,
)
from .llm.layout import (
    LlmConfig,
    Split,
    check_tp_size,
    llm_config,
    qkv_rows,
    rank_shape,
    split_of,
    weight_sources,
)
from .llm.weight_only import FEATURE_MULTIPLE, is_quantized
from .mm.geometry import FRAME_TOKEN_CAP, image_token_count, video_token_count
from .mm.prompt_table import rows_per_visual_token
from .profiles import BuildLimits, GpuProfile, load_profile, profile_names, profile_toml
from .workload import Workload

GIB = 1024**3
FP16 = 2
# CUDA context, cuBLAS workspaces and the TensorRT-LLM runtime's own buffers: a measured
# rule of thumb, not derived from the model.
RUNTIME_OVERHEAD_BYTES = 1 * GIB
# Every TensorRT-LLM rank has this on its card; a rule of thumb that also stands for TP's
# all-reduce workspaces, which are not counted apart.
# The vision engine runs in its own python-backend process: a second CUDA context and the
# TensorRT runtime (its activations are vision_activation_bytes), on rank 0's card. A rule
# of thumb as well.
VISION_PROCESS_OVERHEAD_BYTES = GIB // 2
# The video workload lowers max_batch_size until PromptTuningBuffers::fill's copy of every
# active request's table (each step, context and generation alike: TensorRT-LLM
# cpp/tensorrt_llm/batch_manager/promptTuningBuffers.cpp; NVIDIA/TensorRT-LLM#5889 measured the
# cost) adds at most this share to the decode step's memory read at the caps. The copy
# grows with the batch as the KV reads do, so this bounds the inter-token latency the table
# costs; it does not raise throughput.
MAX_TABLE_COPY_SHARE = 0.25
# The chat workload keeps its prompt table below 2^31 elements at the full batch, the bound its
# plans were sized with while TensorRT refused larger inputs (through 10.10). It is no longer
# TensorRT's limit, but a chat build regenerated for a card keeps its limits; the video
# workload sizes its table by the copy's cost instead.
CHAT_TABLE_ELEMENTS = TABLE_ELEMENT_LIMIT
# The long workload's contexts, longest first: Qwen3-VL's 256K where the KV cache holds one such
# sequence beside the batch, else 128K.
LONG_CONTEXTS = (262144, 131072)

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


# The limits the planner may lower, in the order a profile's limits (for a workload other
# than chat: the limits the workload derives from them, `workload_limits`) are lowered when a
# checkpoint does not fit them: at the profile's context length first, how many requests run
# at once, one at a time down to 1 (what one request may carry, a full-size clip included,
# stays the profile's); when even batch 1 does not fit, the context is halved
# (max_seq_len, and max_input_len in proportion, the visual tokens one request may carry
# capped below it in whole images at limits.vision_max_pixels, a video's budget with them)
# and the batch tried again from the profile's, as long as one image still fits a prompt.
LOWERED_LIMITS = ("max_batch_size", "max_seq_len", "max_input_len",
                  "max_visual_tokens_per_request", "video_max_tokens")


@dataclass(frozen=True)
class LoweredLimit:
    """A limit the plan lowered below the profile's value."""

    key: str  # a BuildLimits field
    profile_value: int
    value: int


@dataclass(frozen=True)
class Plan:
    model: str
    variant: str
    profile: str
    # The limits the plan is for, and the build uses: the profile's, or lowered (`lowered`).
    limits: BuildLimits
    weights: WeightOnly
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
    # The same with the KV cache full of the workload's typical request (its own rows, at most
    # max_batch_size of them).
    prompt_table_copy_bytes_typical: int
    # What a decode step reads at the caps: the weights once and every slot's KV, each slot a
    # request at the visual cap with the typical text and answer. The copy's share is of this.
    decode_step_bytes_at_caps: int
    # The most elements the engine's table may hold (llm/engine.py prompt_table_element_bound
    # for the build's plugins); None: no bound.
    prompt_table_element_bound: int | None
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
    # Limits lowered below the profile's, and what made the next larger value fail.
    lowered: tuple[LoweredLimit, ...] = ()
    lowered_because: str = ""
    # Tensor-parallel ranks, one a card: the figures (weights, KV bytes per token,
    # activations) are rank 0's card's, the most loaded (module docstring).
    tp_size: int = 1
    workload: Workload = Workload.CHAT
    # The limits the workload set apart from the profile's (before any was lowered).
    raised: tuple[LoweredLimit, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def table_copy_share_of_weights(self) -> float:
        """The copy at the caps against the decode step's weight read: a copy reads and writes
        each byte, the weights are read once, both at the card's bandwidth."""
        return 2 * self.prompt_table_copy_bytes_per_step / self.llm_weight_bytes

    @property
    def table_copy_share_of_step(self) -> float:
        """The copy at the caps against all that a decode step at the caps reads."""
        return 2 * self.prompt_table_copy_bytes_per_step / self.decode_step_bytes_at_caps

    @property
    def full_sequences(self) -> int:
        """max_seq_len sequences the KV budget holds at once."""
        return self.kv_capacity_tokens // self.limits.max_seq_len

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


def make_plan(ckpt: Checkpoint, profile: GpuProfile,
              weights: WeightOnly = WeightOnly.NONE, tp_size: int = 1,
              workload: Workload = Workload.CHAT) -> Plan:
    """The plan at the largest limits up to the workload's (workload_limits) that fit
    (LOWERED_LIMITS); when none do, `problems` says why at the smallest, with the fix. With
    `tp_size` ranks, one a card of the profile, for the most loaded card; raises ConfigError
    for a TP size the conversion refuses, PlanError for a workload the checkpoint cannot
    serve."""
    check_tp_size(ckpt.text, tp_size)
    return _fit([(ckpt, weights, workload)], profile, tp_size)[0][0]


def planned_profile(ckpt: Checkpoint, profile: GpuProfile,
                    weights: WeightOnly = WeightOnly.NONE, tp_size: int = 1,
                    workload: Workload = Workload.CHAT) -> GpuProfile:
    """`profile` with the limits make_plan derives for the checkpoint, weights, TP size and
    workload: the profile a build uses."""
    return profile_for_plan(profile, make_plan(ckpt, profile, weights, tp_size, workload))


def workload_limits(ckpt: Checkpoint, lim: BuildLimits,
                    workload: Workload) -> list[BuildLimits]:
    """The limits a workload asks of a profile's `lim`, largest first (the planner tries the
    next when one does not fit at batch 1). A limit the profile already meets is kept, so the
    limits a plan derived are a fixed point. The room a profile leaves for text beside its
    visual cap, and for the answer beside the prompt, is kept.
    - chat: the profile's limits, then its context halved (_context_levels).
    - video: one request may carry the checkpoint's whole clip budget (its
      video_preprocessor_config.json's, in merged tokens), the prompt grown by that, and a
      frame the size its processor caps frames at (the vision engine's largest input raised
      to it where smaller).
    - long: LONG_CONTEXTS up to the checkpoint's max_position_embeddings; chunked context
      (the repository's enable_chunked_context) takes prompts up to max_seq_len - 1 in
      chunks of max_num_tokens."""
    block = lim.tokens_per_block
    answer = lim.max_seq_len - lim.max_input_len
    if workload is Workload.CHAT:
        return list(_context_levels(lim))
    if workload is Workload.VIDEO:
        clip, frame = clip_budget(ckpt)
        cap = max(lim.max_visual_tokens_per_request, clip)
        text = lim.max_input_len - lim.max_visual_tokens_per_request
        prompt = max(lim.max_input_len, -(-(cap + text) // block) * block)
        frame_pixels = frame * PIXELS_PER_IMAGE_TOKEN
        return [replace(lim, max_videos_per_request=max(lim.max_videos_per_request, 1),
                        vision_max_pixels=max(lim.vision_max_pixels, frame_pixels),
                        video_max_pixels_per_frame=max(lim.video_max_pixels_per_frame,
                                                       frame_pixels),
                        video_max_tokens=max(lim.video_max_tokens, clip),
                        max_visual_tokens_per_request=cap, max_input_len=prompt,
                        max_seq_len=prompt + answer)]
    most = ckpt.text.max_position_embeddings
    if lim.max_seq_len >= LONG_CONTEXTS[-1]:
        return [lim]
    contexts = [n for n in LONG_CONTEXTS if n <= most]
    if not contexts:
        raise PlanError(f"the checkpoint's max_position_embeddings ({most}) is below "
                        f"{LONG_CONTEXTS[-1]}: --workload long needs a checkpoint trained for "
                        "that context; use --workload chat")
    return [replace(lim, max_seq_len=n, max_input_len=n - answer) for n in contexts]


def clip_budget(ckpt: Checkpoint) -> tuple[int, int]:
    """Merged tokens of one video at the checkpoint's own clip budget, and of one frame pair
    at most: its video processor's (or, as transformers falls back, its image processor's),
    the released checkpoints' for a folder with config.json alone."""
    # Imported here: mm.video brings the numba kernels, which the planner's importers (the
    # repository writer, validate) do not otherwise need.
    from .mm.video import RELEASED_CLIP_PIXELS, VideoConfig

    if ckpt.video_preprocessor_config or ckpt.preprocessor_config:
        pixels = VideoConfig.of_checkpoint(ckpt).pixels
        return pixels.max_pixels // PIXELS_PER_VIDEO_TOKEN, pixels.frame_token_cap
    return RELEASED_CLIP_PIXELS[1] // PIXELS_PER_VIDEO_TOKEN, FRAME_TOKEN_CAP


def profile_for_plan(profile: GpuProfile, plan: Plan) -> GpuProfile:
    """`profile` with the limits `plan` derived for it; its own limits when the plan does not
    fit (the build's plan stage refuses it)."""
    return replace(profile, limits=plan.limits) if plan.fits else profile


def plan_every_profile(ckpt: Checkpoint, weights: WeightOnly = WeightOnly.NONE,
                       tp_size: int = 1, workload: Workload = Workload.CHAT) \
        -> list[tuple[GpuProfile, Plan]]:
    """The checkpoint against every shipped profile, in profile_names() order: the table a
    platform engineer picks a card from."""
    profiles = [load_profile(name) for name in profile_names()]
    return [(p, make_plan(ckpt, p, weights, tp_size, workload)) for p in profiles]


def plan_every_precision(ckpt: Checkpoint, tp_size: int = 1,
                         workload: Workload = Workload.CHAT) \
        -> list[tuple[GpuProfile, dict[WeightOnly, Plan]]]:
    """plan_every_profile for each weight precision: which card takes the checkpoint in
    which precision, and with what KV budget."""
    return [(p, {w: make_plan(ckpt, p, w, tp_size, workload) for w in WeightOnly})
            for p in (load_profile(name) for name in profile_names())]


@dataclass(frozen=True)
class SharedPlan:
    """Several builds served by one tritonserver on one card."""

    names: tuple[str, ...]
    # Each build's plan at the limits it gets beside the others (its figures are for it
    # alone on the card; kv_budgets are what it gets with the others resident).
    plans: tuple[Plan, ...]
    kv_budgets: tuple[int, ...]  # max_tokens_in_paged_kv_cache of each, in tokens
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def fixed_bytes(self) -> int:
        return sum(p.fixed_bytes for p in self.plans)

    @property
    def concurrent_typical_requests(self) -> tuple[int, ...]:
        return tuple(b // p.typical_request.kv_tokens
                     for p, b in zip(self.plans, self.kv_budgets, strict=True))


def plan_together(models: Sequence[tuple[str, Checkpoint, WeightOnly, Workload]],
                  profile: GpuProfile) -> SharedPlan:
    """Plan builds (name, checkpoint, weights, workload) that one server serves on one card
    (a chat and a video build of one checkpoint, say), lowering limits in the single-card
    order (LOWERED_LIMITS) for all of them at once: at each context length the largest
    max_batch_size among them is lowered by one (or the batch of the build whose prompt table
    costs too much), the later build first on a tie. Their KV budgets are
    repository_kv_budgets'."""
    names = tuple(model[0] for model in models)
    if len(set(names)) != len(names):
        raise PlanError(f"two models are named alike in {', '.join(names)}; name each "
                        "--model NAME=PATH")
    alone = tuple(make_plan(ckpt, profile, weights, workload=workload)
                  for _, ckpt, weights, workload in models)
    for name, plan in zip(names, alone, strict=True):
        if not plan.fits:
            return SharedPlan(names, alone, (0,) * len(alone), (f"{name}: {plan.problems[0]}",))
    plans, problems = _fit([model[1:] for model in models], profile)
    if problems:
        return SharedPlan(names, tuple(plans), (0,) * len(plans), (
            f"{' and '.join(names)} do not fit together on one {profile.name} "
            f"({profile.memory_bytes / GIB:.1f} GiB): {problems[0]}; serve them on separate "
            "GPUs",))
    return SharedPlan(names, tuple(plans), repository_kv_budgets(plans), ())


def save_planned_profiles(folder: Path, profile: GpuProfile,
                          plans: Sequence[tuple[str, Plan]]) -> list[Path]:
    """Write `profile` with each named plan's limits to FOLDER/<profile>-<name>.toml (what
    `qvl-trt build --gpu` takes: a build plans such a profile alone on the card and keeps
    limits that already fit); the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plan in plans:
        path = folder / f"{profile.name}-{name}.toml"
        others = [n for n, _ in plans if n != name]
        beside = f", beside {' and '.join(others)}" if others else ""
        comment = (f"{profile.gpu.description} for {name} ({plan.variant}, "
                   f"{plan.weights.value} weights, {plan.workload} workload{beside}): the "
                   f"profile {profile.name} with the limits `qvl-trt plan` derived.\n"
                   + "\n".join(f"{f.name}: {getattr(profile.limits, f.name)} in the profile"
                                for f in fields(BuildLimits)
                                if getattr(plan.limits, f.name) != getattr(profile.limits,
                                                                           f.name)))
        with staged_file(path, "w") as f:
            f.write(profile_toml(replace(profile, limits=plan.limits), comment))
        written.append(path)
    return written


def check_fits(plan: Plan) -> None:
    """Raise PlanError with the first problem (the one-line message the CLI prints)."""
    if plan.problems:
        raise PlanError(
            f"{plan.variant} checkpoint does not fit profile {plan.profile}"
            f"{_weights_words(plan.weights)}{_tp_words(plan.tp_size)}: {plan.problems[0]}"
        )


def check_fits_together(shared: SharedPlan) -> None:
    if shared.problems:
        raise PlanError(shared.problems[0])


@dataclass(frozen=True)
class _Problem:
    binds: str  # what bounds the limits, for Plan.lowered_because
    message: str  # the whole line, with the fix
    build: int | None = None  # the build whose own batch relieves it; None: any


def _fit(models: Sequence[tuple[Checkpoint, WeightOnly, Workload]], profile: GpuProfile,
         tp_size: int = 1) -> tuple[list[Plan], tuple[str, ...]]:
    """Plans for builds sharing the card at the largest limits (LOWERED_LIMITS) where no
    build has a problem; with the problems at the smallest limits tried when there are none.
    One build is the single-card plan (with `tp_size` ranks, rank 0's card). A build whose
    workload has fewer context levels than another's stays at its last one."""
    levels = [workload_limits(ckpt, profile.limits, workload) for ckpt, _, workload in models]
    left: _Problem | None = None  # why the previous context level was left
    for depth in range(max(len(each) for each in levels)):
        limits: list[BuildLimits] | None = [each[min(depth, len(each) - 1)] for each in levels]
        before: _Problem | None = None  # what failed at the next larger batch
        while limits is not None:
            plans = [_figures(ckpt, replace(profile, limits=lim), weights, tp_size, workload)
                     for (ckpt, weights, workload), lim in zip(models, limits, strict=True)]
            problem = _problem(plans)
            if problem is None:
                return [_with_lowered(p, profile.limits, each[0], (left, before))
                        for p, each in zip(plans, levels, strict=True)], ()
            before = problem
            limits = _lower_batch(limits, problem)
        left = problem
    plans = [_with_lowered(p, profile.limits, each[0], (left,))
             for p, each in zip(plans, levels, strict=True)]
    if len(plans) == 1:
        plans[0] = replace(plans[0], problems=(problem.message,))
    return plans, (problem.message,)


def _context_levels(lim: BuildLimits) -> Iterator[BuildLimits]:
    """The profile's limits, then its context halved while one image still fits a prompt
    (see LOWERED_LIMITS)."""
    yield lim
    block, step, seq = lim.tokens_per_block, lim.max_image_tokens, lim.max_seq_len
    while True:
        seq = seq // 2 // block * block
        prompt = lim.max_input_len * seq // lim.max_seq_len // block * block
        cap = min(lim.max_visual_tokens_per_request, (prompt - 1) // step * step)
        if cap < step:
            return
        yield replace(lim, max_seq_len=seq, max_input_len=prompt,
                      max_visual_tokens_per_request=cap,
                      video_max_tokens=min(lim.video_max_tokens, cap))


def _lower_batch(limits: Sequence[BuildLimits], problem: _Problem) -> list[BuildLimits] | None:
    """`limits` with one build's max_batch_size lowered by one: the build the problem names,
    else the largest batch (the later build on a tie); None when that is already 1."""
    i = problem.build if problem.build is not None else max(
        range(len(limits)), key=lambda j: (limits[j].max_batch_size, j))
    if limits[i].max_batch_size == 1:
        return None
    out = list(limits)
    out[i] = replace(out[i], max_batch_size=out[i].max_batch_size - 1)
    return out


def _with_lowered(plan: Plan, profile: BuildLimits, largest: BuildLimits,
                  because: Sequence[_Problem | None]) -> Plan:
    """`plan` with the limits its workload raised above the profile's (to `largest`) and
    those lowered below `largest`, and why (each distinct reason once)."""
    raised = tuple(LoweredLimit(f.name, getattr(profile, f.name), getattr(largest, f.name))
                   for f in fields(BuildLimits)
                   if getattr(largest, f.name) != getattr(profile, f.name))
    lowered = tuple(LoweredLimit(key, getattr(largest, key), getattr(plan.limits, key))
                    for key in LOWERED_LIMITS
                    if getattr(plan.limits, key) != getattr(largest, key))
    reasons = dict.fromkeys(p.binds for p in because if p is not None)
    return replace(plan, raised=raised, lowered=lowered,
                   lowered_because="; ".join(reasons) if lowered else "")


def _weights_words(weights: WeightOnly) -> str:
    return "" if weights is WeightOnly.NONE else f" with {weights.value.upper()} weights"


def _tp_words(tp_size: int) -> str:
    return "" if tp_size == 1 else f" at tensor-parallel size {tp_size} (one card a rank)"


def _smallest(plans: Sequence[Plan]) -> str:
    """The limits a failed fit ended at, for its message."""
    lim = plans[0].limits
    each = " each" if len(plans) > 1 else ""
    return f"max_batch_size {lim.max_batch_size} and max_seq_len {lim.max_seq_len}{each}"


def _weights_fix(plans: Sequence[Plan]) -> str:
    """The smaller weight precisions left to try, as the start of a fix."""
    smaller = [w.value for w in WeightOnly if w is not WeightOnly.NONE
               and all(p.weights.bits is None or w.bits < p.weights.bits for p in plans)]
    return f"build with --weights {' or '.join(smaller)} (weight-only), " if smaller else ""


def _problem(plans: Sequence[Plan]) -> _Problem | None:
    """The first reason the builds cannot work on the card together (one build: alone)."""
    gpu = plans[0].gpu_memory_bytes
    fixed = sum(p.fixed_bytes for p in plans)
    at = _smallest(plans)
    fix = _weights_fix(plans)
    if fixed >= gpu:
        return _Problem(
            "weights and buffers above the card's memory",
            f"weights and buffers need {fixed / GIB:.1f} GiB of the {gpu / GIB:.1f} GiB on "
            f"{plans[0].profile} even at {at}: {fix}use a smaller checkpoint or a card with "
            "more memory, or lower limits.max_num_tokens (activations)")
    for i, p in enumerate(plans):
        bound = p.prompt_table_element_bound
        if bound is not None and p.prompt_table_elements >= bound:
            return _Problem(
                f"prompt table at {bound:,} elements (lookup_plugin)",
                f"the prompt table holds {p.prompt_table_elements:,} elements{_of(p, plans)}, "
                f"at or above the {bound:,} lookup_plugin indexes, even at {at}: build "
                "without lookup_plugin, or lower limits.max_visual_tokens_per_request",
                build=i)
        if p.workload is Workload.CHAT and p.prompt_table_elements >= CHAT_TABLE_ELEMENTS:
            return _Problem(
                f"prompt table at {CHAT_TABLE_ELEMENTS:,} elements (the chat workload's bound)",
                f"the prompt table holds {p.prompt_table_elements:,} elements{_of(p, plans)}, "
                f"at or above the chat workload's {CHAT_TABLE_ELEMENTS:,}, even at {at}: lower "
                "limits.max_visual_tokens_per_request, or build --workload video (the table "
                "sized by its copy's cost)", build=i)
        if p.workload is Workload.VIDEO and p.table_copy_share_of_step > MAX_TABLE_COPY_SHARE:
            return _Problem(
                f"the prompt-table copy at the caps would add {p.table_copy_share_of_step:.1%} "
                f"to the decode step at batch {p.limits.max_batch_size} (at most "
                f"{MAX_TABLE_COPY_SHARE:.0%})",
                f"the prompt-table copy at the caps adds {p.table_copy_share_of_step:.0%} to "
                f"the decode step{_of(p, plans)} even at {at}, more than "
                f"{MAX_TABLE_COPY_SHARE:.0%}: lower limits.max_visual_tokens_per_request",
                build=i)
    budgets = [_whole_blocks(b, p) for b, p in zip(_kv_shares(plans), plans, strict=True)]
    for p, tokens in zip(plans, budgets, strict=True):
        lim = p.limits
        typical = workload_typical(p)
        # The long workload promises one full-length sequence while the rest of the batch
        # runs typical requests; the others one full-length sequence at all.
        others = lim.max_batch_size - 1
        if p.workload is Workload.LONG and tokens < lim.max_seq_len + others * typical.kv_tokens:
            beside = f" beside {others} typical requests" if others else ""
            return _Problem(
                f"KV cache below one {lim.max_seq_len}-token sequence{beside}",
                f"the KV cache holds {tokens} tokens{_of(p, plans)}, less than one "
                f"{lim.max_seq_len}-token sequence{beside} even at {at}: {fix}use a card with "
                "more memory, tensor parallelism (--tp-size), or --workload chat")
        if tokens < lim.max_seq_len:
            return _Problem(
                "KV cache below one max_seq_len sequence",
                f"the KV cache holds {tokens} tokens{_of(p, plans)}, less than one request "
                f"of limits.max_seq_len ({lim.max_seq_len}) even at {at}: {fix}lower "
                "limits.max_seq_len, or use a card with more memory")
        if tokens // typical.kv_tokens < lim.max_batch_size:
            return _Problem(
                "KV cache below max_batch_size typical requests",
                f"the KV cache holds {tokens // typical.kv_tokens} concurrent "
                f"typical requests{_of(p, plans)} ({typical.media}, "
                f"{typical.kv_tokens} tokens), fewer than limits.max_batch_size "
                f"({lim.max_batch_size}): {fix}lower limits.vision_max_pixels, or use a card "
                "with more memory")
    return None


def workload_typical(plan: Plan) -> TypicalRequest:
    """The request a workload's batch is sized for: the clip for video, else the image."""
    return plan.typical_video if plan.workload is Workload.VIDEO else plan.typical_request


def _of(plan: Plan, plans: Sequence[Plan]) -> str:
    """Which build a problem of several is about: its checkpoint folder."""
    return f" for {Path(plan.model).name}" if len(plans) > 1 else ""


@functools.cache
def _rank_config(text: TextDims, vision: VisionDims, tp_size: int) -> LlmConfig:
    return llm_config(text, len(vision.deepstack_visual_indexes), dtype=LLM_ENGINE_DTYPE,
                      tp_size=tp_size, max_position_embeddings=text.max_position_embeddings)


@functools.cache
def llm_weight_bytes(text: TextDims, vision: VisionDims, weights: WeightOnly,
                     tp_size: int = 1) -> int:
    """Bytes of the language-model weights one rank's engine holds: every weight of the
    converted checkpoint at its rank shape (llm/layout.py: split or replicated), the
    decoder's linear layers (llm/weight_only.py) through WeightOnly.linear_bytes (packed
    integers and one scale per output channel, feature counts padded as the engine's layer
    pads them), the embedding, lm_head (kept apart from the embedding even when HF ties them)
    and the norms in the engine dtype."""
    config = _rank_config(text, vision, tp_size)
    shapes = expected_shapes(text, vision)
    total = 0
    for name, sources in weight_sources(text).items():
        shape = rank_shape(name, [shapes[s] for s in sources], config)
        if is_quantized(name) and weights is not WeightOnly.NONE:
            out_features, in_features = _padded_features(name, shape, tp_size)
            total += weights.linear_bytes(in_features, out_features, LLM_ENGINE_DTYPE)
        else:
            total += math.prod(shape) * LLM_ENGINE_DTYPE.itemsize
    return total


def _padded_features(name: str, shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """A rank's (out, in) features of a weight-only linear as the engine holds them.
    WeightOnlyQuantLinear pads both full feature counts to a multiple of 64 x TP size before
    the split (tensorrt_llm/quantization/layers.py): the split one is then a multiple of 64 a
    rank, the other stays whole. Conversion refuses sizes that would be padded at all."""
    split = 1 if split_of(name) is Split.COLS else 0
    return tuple(-(-n // m) * m for n, m in (
        (n, FEATURE_MULTIPLE if d == split else FEATURE_MULTIPLE * tp_size)
        for d, n in enumerate(shape)))


@functools.cache
def _vision_parameters(text: TextDims, vision: VisionDims) -> int:
    return sum(math.prod(shape) for name, shape in expected_shapes(text, vision).items()
               if name.startswith(VISION_PREFIX))


def _figures(ckpt: Checkpoint, profile: GpuProfile, weights: WeightOnly,
             tp_size: int = 1, workload: Workload = Workload.CHAT) -> Plan:
    """Rank 0's card (module docstring): its share of the language model, the whole vision
    model, and the buffers every rank holds whole (the prompt table: the embedding is not
    split; the MRoPE tables)."""
    t, v, lim = ckpt.text, ckpt.vision, profile.limits
    config = _rank_config(t, v, tp_size)
    max_patches = lim.vision_max_pixels // (v.patch_size**2)
    vision_act = max_patches * (6 * v.hidden_size + 2 * v.intermediate_size) * FP16
    # A rank computes its heads' q, k, v and its share of the MLP; the hidden states and
    # the logits (lm_head gathers its output) are whole on every rank.
    qkv = sum(qkv_rows(config))
    llm_act = (
        lim.max_num_tokens
        * (qkv + 3 * t.hidden_size + 2 * t.intermediate_size // tp_size) * FP16
        + lim.max_batch_size * t.vocab_size * 4
    )  # fp32 logits of the last tokens
    rows = prompt_table_rows(lim, v.deepstack_count)
    row_bytes = t.hidden_size * FP16
    per_token = rows_per_visual_token(v.deepstack_count) * row_bytes
    kv_per_token = 2 * t.num_layers * qkv_rows(config)[1] * FP16
    at_cap = _typical(lim, "", lim.max_visual_tokens_per_request, TYPICAL_TEXT_TOKENS, "")
    # (cos, sin) per position and frequency, fp32, positions bounded by max_seq_len.
    mrope_per_request = lim.max_seq_len * t.head_dim * 4
    plan = Plan(
        model=str(ckpt.path),
        variant=ckpt.variant,
        profile=profile.name,
        limits=lim,
        weights=weights,
        gpu_memory_bytes=profile.memory_bytes,
        vision_weight_bytes=_vision_parameters(t, v) * FP16,
        llm_weight_bytes=llm_weight_bytes(t, v, weights, tp_size),
        vision_activation_bytes=vision_act,
        llm_activation_bytes=llm_act,
        runtime_overhead_bytes=RUNTIME_OVERHEAD_BYTES + VISION_PROCESS_OVERHEAD_BYTES,
        prompt_table_rows=rows,
        prompt_table_rows_per_request=rows // lim.max_batch_size,
        prompt_table_elements=rows * t.hidden_size,
        prompt_table_bytes=rows * row_bytes,
        prompt_table_copy_bytes_per_step=lim.max_batch_size
        * (rows // lim.max_batch_size) * row_bytes,
        prompt_table_copy_bytes_typical=0,
        decode_step_bytes_at_caps=llm_weight_bytes(t, v, weights, tp_size)
        + lim.max_batch_size * min(at_cap.kv_tokens, lim.max_seq_len) * kv_per_token,
        prompt_table_element_bound=prompt_table_element_bound(
            engine_build_config(profile, deepstack_layers=v.deepstack_count,
                                weights=weights)["plugin_config"]),
        mrope_table_bytes_per_request=mrope_per_request,
        mrope_table_bytes=mrope_per_request * lim.max_batch_size,
        shm_bytes=lim.max_batch_size * (
            2 * lim.max_visual_tokens_per_request * v.spatial_merge_size**2 * v.patch_dim
            + 2 * 3 * lim.max_input_len * 8
            + mrope_per_request + 3 * (rows // lim.max_batch_size) * row_bytes),
        # K and V of this rank's KV heads in every layer, fp16. TensorRT-LLM gives a rank
        # ceil(KV heads / TP) heads (tensorrt_llm/_torch/pyexecutor/resource_manager.py,
        # KVCacheManager num_kv_heads_per_layer); check_tp_size keeps that exact.
        kv_bytes_per_token=kv_per_token,
        kv_cache_bytes=0,
        kv_capacity_tokens=0,
        typical_request=_typical_request(profile),
        concurrent_typical_requests=0,
        typical_video=_typical_video(profile),
        concurrent_typical_videos=0,
        problems=(),
        tp_size=tp_size,
        workload=workload,
    )
    kv_bytes = _kv_shares([plan])[0]
    capacity = _whole_blocks(kv_bytes, plan)
    video = plan.typical_video
    plan = replace(
        plan,
        kv_cache_bytes=kv_bytes,
        kv_capacity_tokens=capacity,
        concurrent_typical_requests=capacity // plan.typical_request.kv_tokens,
        concurrent_typical_videos=0 if video.refused
        else min(capacity // video.kv_tokens, lim.max_batch_size),
    )
    typical = workload_typical(plan)
    at_once = 0 if typical.refused else min(capacity // typical.kv_tokens, lim.max_batch_size)
    return replace(plan, prompt_table_copy_bytes_typical=at_once * typical.visual_tokens
                   * per_token)


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
            f"limits.max_seq_len sequence; serve them on separate GPUs, or build them with "
            "the profiles `qvl-trt plan --model NAME=CHECKPOINT ... --gpu GPU --weights W "
            "--save-profiles DIR` writes for the card they share"
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
