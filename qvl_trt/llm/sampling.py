"""Generation requests, sampling parameters and results of the reference decoder, and the
token choice itself (greedy, or temperature -> top-k -> top-p -> multinomial)."""

from __future__ import annotations

import enum
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..deps import require
from ..errors import InputError
from .guided import Guide

log = logging.getLogger(__name__)

# The largest top_k TensorRT-LLM samples with: a larger one is clipped to it, with a warning
# (cpp/tensorrt_llm/kernels/samplingTopKKernels.h TOP_K_MAX; TopKSamplingLayer::setup in
# cpp/tensorrt_llm/layers/topKSamplingLayer.cpp clamps every request's top_k).
TOP_K_MAX = 1024

# TensorRT-LLM scales logits by 1 / (temperature + 1e-6) in float32, and not at all at its
# default temperature 1 (the sampling layers' penalty kernel:
# cpp/tensorrt_llm/kernels/penaltyKernels.cu batchApplyPenalty, `invTemperature = 1.0f /
# (temperature + 1e-6f)`, applied unless almostEqual(temperature, 1, 1e-9), the default of
# layers/defaultDecodingParams.h); its executor takes any temperature >= 0
# (cpp/tensorrt_llm/executor/samplingConfig.cpp checkTemperature). So a temperature far below
# float32's normal range (1e-40, 1e-45; float32 makes them subnormal or 0) scales as 0 does,
# by 1e6: the stand-in computes it the same way, and a temperature whose scale equals 0's is
# greedy (what the ensemble asks for at temperature 0).
TEMPERATURE_EPSILON = np.float32(1e-6)


def inverse_temperature(temperature: float) -> np.float32:
    """The factor TensorRT-LLM multiplies the logits by, computed as it does."""
    with np.errstate(over="ignore"):  # beyond float32: inf, a factor of 0
        t = np.float32(temperature)
        if abs(float(t) - 1.0) < 1e-9:
            return np.float32(1)
        return np.float32(1) / (t + TEMPERATURE_EPSILON)


def scales_as_greedy(temperature: float) -> bool:
    """True where TensorRT-LLM cannot tell the temperature from 0."""
    return inverse_temperature(temperature) == inverse_temperature(0.0)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was generated (it is the last token returned)
    LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Greedy when `greedy`, `top_k == 1` or a temperature that scales
    as 0 does (scales_as_greedy); otherwise temperature scaling (as TensorRT-LLM scales), then
    top-k (0 = off; above TOP_K_MAX clipped to it, as TensorRT-LLM does), then top-p (1 =
    off). `end_id` is never chosen before `min_tokens` tokens (TensorRT-LLM masks the end
    id's logit until then, penaltyKernels.cu; stop words are not held back)."""

    max_tokens: int = 16
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    end_id: int | None = None

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0,
             "a number >= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed), "an integer"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "non-negative token ids"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "an integer >= 0"),
            ("end_id", self.end_id is None or (_is_int(self.end_id) and self.end_id >= 0),
             "a token id"),
        )  # fmt: skip
        for name, ok, what in checks:
            if not ok:
                raise InputError(f"sampling {name} = {getattr(self, name)!r} must be {what}")
        # numpy scalars (Triton inputs) become plain Python numbers.
        for name, kind in (("max_tokens", int), ("temperature", float), ("top_k", int),
                           ("top_p", float), ("min_tokens", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.top_k > TOP_K_MAX:
            log.warning("top_k %d is larger than the %d TensorRT-LLM samples from; clipped to "
                        "%d", self.top_k, TOP_K_MAX, TOP_K_MAX)
            object.__setattr__(self, "top_k", TOP_K_MAX)
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or scales_as_greedy(self.temperature) or self.top_k == 1


@dataclass(frozen=True)
class DecodeRequest:
    """One request in the TensorRT-LLM engine's input contract.

    input_ids: prompt token ids; visual tokens carry fake ids vocab_size + (1+K)*i.
    prompt_table: [(1+K) * visual tokens, hidden] rows the fake ids index (None if none).
    mrope_rotary_cos_sin: fp32, max_position_embeddings * rotary_dim values: per position
        and frequency a (cos, sin) pair (`mrope_rotary_cos_sin` of the engine).
    mrope_position_delta: the request's `mrope_position_deltas` value.
    guide: the structure its answer must take (guided decoding), or None.
    """

    input_ids: tuple[int, ...]
    mrope_rotary_cos_sin: Any
    mrope_position_delta: int
    prompt_table: Any = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_context_logits: bool = False
    return_generation_logits: bool = False
    guide: Guide | None = None

    def __post_init__(self) -> None:
        # numpy or torch ids become plain ints.
        object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        object.__setattr__(self, "mrope_position_delta", int(self.mrope_position_delta))


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as streamed: `request` is the index in the batch."""

    request: int
    token_id: int
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class DecodeResult:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    visual_tokens: int
    context_logits: Any = None  # fp32 [prompt_tokens, vocab] when requested
    generation_logits: Any = None  # fp32 [completion_tokens, vocab] when requested

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def make_generator(seed: int | None):
    """The request's random stream; unseeded requests draw a fresh seed."""
    torch = require("torch", extra="export", why="sample tokens")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator().manual_seed(seed)


def choose_token(logits, params: SamplingParams, generator, generated: int = 0) -> int:
    """Pick the next token from one row of fp32 logits, `generated` tokens into the answer."""
    torch = require("torch", extra="export", why="sample tokens")
    held = params.end_id is not None and generated < params.min_tokens
    if params.is_greedy:
        if held:
            logits = logits.clone()
            logits[params.end_id] = -math.inf
        return int(torch.argmax(logits))
    logits = logits.float().cpu() * float(inverse_temperature(params.temperature))
    if held:
        logits[params.end_id] = -math.inf
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        logits[order[drop]] = -math.inf
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))
