"""A checkpoint's generation_config.json, read once: its sampling defaults, end ids and pad id.

The in-process reference pipeline and the served ensemble both take their defaults from here,
so the oracle decodes as the deployment does. The semantics are transformers' GenerationConfig
(5.x, generation/configuration_utils.py): it samples only when `do_sample` is true
(`get_generation_mode`: `do_sample is not True` -> greedy search), and a value the file
leaves out takes `_get_default_generation_params` (temperature 1.0, top_k 50, top_p 1.0).
Without the file, transformers derives the config from config.json (`from_model_config`):
greedy, with the eos and pad ids of its top level, else of its text_config.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

# transformers' _get_default_generation_params for the settings the engine takes.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a setting out gets. temperature 0: greedy; top_k 0 and
    top_p 1: off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class GenerationConfig:
    """The fields of generation_config.json that generation uses."""

    end_ids: tuple[int, ...]  # eos_token_id: generation ends at any of them
    do_sample: bool = False
    temperature: float = _TRANSFORMERS_DEFAULTS["temperature"]
    top_k: int = _TRANSFORMERS_DEFAULTS["top_k"]
    top_p: float = _TRANSFORMERS_DEFAULTS["top_p"]
    pad_token_id: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, model_config: Mapping[str, Any], *,
                  where: str = "generation_config.json") -> GenerationConfig:
        """`data`: the file's object (None: no file); `model_config`: config.json's, for the
        ids the file leaves out. Mistyped values raise CheckpointError naming `where`."""
        data = data or {}

        def value(key: str, ok, what: str) -> Any:
            if data.get(key) is None:
                return None
            if not ok(data[key]):
                raise CheckpointError(f"{where}: {key} = {data[key]!r} must be {what}; fix or "
                                      "remove it")
            return data[key]

        def model_id(key: str) -> Any:
            text = model_config.get("text_config") or {}
            return next((c[key] for c in (model_config, text) if c.get(key) is not None), None)

        eos = value("eos_token_id", _is_ids, "a token id or a list of them")
        if eos is None:
            eos = model_id("eos_token_id")
        if not _is_ids(eos):
            raise CheckpointError(f"{where} and config.json name no eos_token_id; add the "
                                  "model's end token id(s) to generation_config.json")
        given = {
            "do_sample": value("do_sample", lambda v: isinstance(v, bool), "true or false"),
            "temperature": value("temperature", lambda v: _is_number(v) and v >= 0,
                                 "a number >= 0"),
            "top_k": value("top_k", _is_id, "an integer >= 0"),
            "top_p": value("top_p", lambda v: _is_number(v) and 0 < v <= 1, "in (0, 1]"),
            "pad_token_id": value("pad_token_id", _is_id, "a token id"),
        }
        if given["pad_token_id"] is None and _is_id(model_id("pad_token_id")):
            given["pad_token_id"] = model_id("pad_token_id")
        return cls(end_ids=tuple(int(t) for t in (eos if isinstance(eos, list) else [eos])),
                   **{k: v for k, v in given.items() if v is not None})

    def sampling_defaults(self) -> SamplingDefaults:
        """Greedy unless do_sample is true, as transformers generates."""
        if not self.do_sample:
            return SamplingDefaults(temperature=0.0)
        return SamplingDefaults(float(self.temperature), float(self.top_p), int(self.top_k))

    @property
    def pad_id(self) -> int:
        """pad_token_id, else the first end id (TensorRT-LLM needs one)."""
        return self.end_ids[0] if self.pad_token_id is None else self.pad_token_id


def _is_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _is_ids(value: object) -> bool:
    return _is_id(value) or (isinstance(value, list) and bool(value)
                             and all(_is_id(v) for v in value))


def _is_number(value: object) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))
