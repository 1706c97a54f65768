"""The preprocessing step: one request's public inputs -> the tensors of the later steps
(named by the contract, without the batch dimension)."""

from __future__ import annotations

import ctypes
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import EngineLimitError
from ...llm.sampling import scales_as_greedy
from ...mm.pixels import warm_up
from ...mm.request import RequestLimits, RequestPreprocessor
from .. import contract as c
from .request_inputs import UrlPolicy, chat_request


class Preprocessor:
    def __init__(self, checkpoint_dir: Path, limits: c.PreprocessingParameters) -> None:
        self.limits = limits
        self.requests = RequestPreprocessor.from_checkpoint(checkpoint_dir,
                                                            RequestLimits.from_fields(limits))
        generation = self.requests.checkpoint.generation
        self.defaults = generation.sampling_defaults()
        self.end_id = generation.end_ids[0]
        # TensorRT-LLM takes one end id; the others stop generation as one-token stop words.
        self.extra_end_ids = [[t] for t in generation.end_ids[1:]]
        self.pad_id = generation.pad_id
        self.urls = UrlPolicy.from_parameter(limits.image_url_allow_list)
        _map_large_allocations()
        warm_up(self.requests.pixels)  # the pixel kernels compile here, not in a request
        self.idle_rss = _rss_bytes()

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """`inputs`: public input name -> value (scalars unwrapped, absent ones missing)."""
        try:
            return self._prepare(inputs)
        finally:
            if _rss_bytes() > self.idle_rss + _TRIM_ABOVE_IDLE_BYTES:
                _give_back_freed_memory()

    def _prepare(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        limits = self.requests.limits
        request = chat_request(inputs, urls=self.urls, defaults=self.defaults, limits=limits)
        s = request.settings
        tokenizer = self.requests.prompts.tokenizer
        stops = [tokenizer.encode(text, add_special_tokens=False) for text in s.stop]
        limits.bounds.check("the number of tokens of all stop strings", sum(map(len, stops)),
                            "max_stop_tokens", "send fewer or shorter stop strings")
        prepared = self.requests.prepare(messages=request.messages, images=request.images,
                                         videos=request.videos, tools=request.tools,
                                         cache_scope=request.cache_scope)
        prompt_tokens = prepared.num_tokens
        room = self.limits.max_seq_len - prompt_tokens
        max_tokens = min(self.limits.default_max_tokens, room) if s.max_tokens is None \
            else s.max_tokens
        if max_tokens > room:
            raise EngineLimitError(
                f"max_tokens = {max_tokens} is above the limit: the prompt has {prompt_tokens} "
                f"tokens and the engine holds {self.limits.max_seq_len} per sequence, so at most "
                f"{room} can be generated; lower max_tokens")
        c.check_min_tokens(s.min_tokens, max_tokens, defaulted=s.max_tokens is None)
        greedy = scales_as_greedy(s.temperature) or s.top_k == 1
        seed = s.seed if s.seed is not None else secrets.randbits(63)

        def scalar(value, dtype) -> np.ndarray:
            return np.array([value], dtype)

        # The prepared arrays already have the contract's dtypes: passed on, not copied.
        return {
            c.INPUT_IDS: prepared.engine_input_ids,
            c.INPUT_LENGTHS: scalar(prompt_tokens, np.int32),
            c.REQUEST_OUTPUT_LEN: scalar(max_tokens, np.int32),
            # ignore_eos: no end id, and the other end ids are no stop words; min_tokens then
            # has no end id to hold back (the stock kernel would mask index -1).
            c.END_ID: scalar(c.NO_END_ID if s.ignore_eos else self.end_id, np.int32),
            c.PAD_ID: scalar(self.pad_id, np.int32),
            c.STREAMING: scalar(s.stream, np.bool_),
            c.MIN_TOKENS: scalar(0 if s.ignore_eos else s.min_tokens, np.int32),
            # Greedy as TensorRT-LLM spells it: top_k 1 (temperature 0 is not accepted there).
            c.TEMPERATURE: scalar(1.0 if greedy else s.temperature, np.float32),
            c.RUNTIME_TOP_K: scalar(1 if greedy else s.top_k, np.int32),
            c.RUNTIME_TOP_P: scalar(1.0 if greedy else s.top_p, np.float32),
            c.SEED: scalar(seed, np.uint64),
            c.STOP_WORDS_LIST: c.stop_words_list(
                stops + ([] if s.ignore_eos else self.extra_end_ids)),
            c.PROMPT_TABLE_EXTRA_IDS: prepared.prompt_table_extra_ids,
            c.MROPE_POSITION_IDS: prepared.position_ids,
            c.MROPE_POSITION_DELTAS: scalar(prepared.mrope_position_delta, np.int64),
            c.PIXEL_VALUES: prepared.pixel_values,
            c.IMAGE_GRID_THW: prepared.image_grid_thw,
            c.IMAGE_HASHES: prepared.image_hashes,
            c.MEDIA_TOKENS: np.array(prepared.media_tokens, np.int32),
        }


# RSS above the idle process's after which a request's freed memory is handed back: a
# 1080p image's request stays below it (the trim would cost it 1 ms of its 30), an
# 8000x8000 one leaves hundreds of MB.
_TRIM_ABOVE_IDLE_BYTES = 64 * 2**20


def _rss_bytes() -> int:
    """This process's resident set size (/proc/self/statm: a few microseconds)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# glibc's malloc_trim and mallopt, or None where the C library has them not (musl, macOS).
_LIBC = ctypes.CDLL(None)
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
_MALLOPT = getattr(_LIBC, "mallopt", None)
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
# Allocations from this size up get pages of their own, unmapped when freed: below Pillow's
# 16 MiB blocks, so a decoded image's memory goes back to the system as soon as it is freed.
_MMAP_THRESHOLD_BYTES = 4 * 2**20


def _map_large_allocations() -> None:
    """Fix glibc's mmap threshold (by default it rises to the largest block freed, up to 32
    MiB, after which a large image's blocks come from the heap and stay there when freed, so
    one request's peak adds up with what earlier ones left)."""
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def _give_back_freed_memory() -> None:
    """Return the heap's free pages to the system after a request. glibc keeps what a
    request freed (a decoded 8000x8000 image: hundreds of MB, in the arenas of the pixel
    pool's threads too) for the next allocations; trimmed, the process's RSS goes back to
    its idle size (about 1 ms)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
