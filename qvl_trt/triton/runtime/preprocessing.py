"""The preprocessing step: one request's public inputs -> the tensors of the later steps
(named by the contract, without the batch dimension)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
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
        warm_up(self.requests.pixels)  # the pixel kernels compile here, not in a request

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """`inputs`: public input name -> value (scalars unwrapped, absent ones missing)."""
        limits = self.requests.limits
        request = chat_request(inputs, urls=self.urls, defaults=self.defaults, limits=limits)
        s = request.settings
        tokenizer = self.requests.prompts.tokenizer
        stops = [tokenizer.encode(text, add_special_tokens=False) for text in s.stop]
        limits.bounds.check("the number of tokens of all stop strings", sum(map(len, stops)),
                            "max_stop_tokens", "send fewer or shorter stop strings")
        prepared = self.requests.prepare(messages=request.messages, images=request.images,
                                         videos=request.videos)
        prompt_tokens = prepared.num_tokens
        room = self.limits.max_seq_len - prompt_tokens
        max_tokens = min(self.limits.default_max_tokens, room) if s.max_tokens is None \
            else s.max_tokens
        if max_tokens > room:
            raise InputError(
                f"max_tokens = {max_tokens} is above the limit: the prompt has {prompt_tokens} "
                f"tokens and the engine holds {self.limits.max_seq_len} per sequence, so at most "
                f"{room} can be generated; lower max_tokens")
        if s.min_tokens > max_tokens:
            raise InputError(f"min_tokens = {s.min_tokens} is above max_tokens = {max_tokens} "
                             "(the deployment's default where max_tokens is left out); send "
                             "min_tokens <= max_tokens")
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
        }


