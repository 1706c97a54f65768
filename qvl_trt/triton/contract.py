"""The tensor contract of the generated Triton repository.

Two layers:
- the ensemble's public inputs and outputs (what clients send and receive);
- the tensors passed between its steps. Names and types of the `tensorrt_llm` step's tensors
  are the stock TensorRT-LLM backend's (its all_models/inflight_batcher_llm/tensorrt_llm
  config), so that step is the unmodified backend in the trt flavor and a python model with
  the same I/O in the reference flavor.

Data types are Triton's names without the `TYPE_` prefix; dims exclude the batch dimension
(every model is built with max_batch_size > 0, so clients send a leading batch dim of 1).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    BusyError,
    ConfigError,
    EngineLimitError,
    FieldError,
    InputError,
    LimitError,
    QvlError,
    UnavailableError,
)
from ..typed_config import load_parameters, to_parameters
from .options import Flavor
from .tensorrtllm_backend import FALSE as BACKEND_FALSE
from .tensorrtllm_backend import TRUE as BACKEND_TRUE
from .tensorrtllm_backend import parse_bool

if TYPE_CHECKING:  # the gateway reads this module: it stays free of mm/ (and numba, PIL)
    from ..mm.rope import MropeTable

# ---- model names ----------------------------------------------------------------------------
# The ensemble's steps: preprocessing -> vision_encoder -> postprocessing; postprocessing runs
# tensorrt_llm (a separate model of the repository) for each request, see below.
# tensorrt_llm_bls serves the ensemble's API as one decoupled python model that runs those steps
# by BLS: a client's cancel reaches it (Triton's ensemble scheduler does not pass a cancel to a
# step already running), and it stops tensorrt_llm.

PREPROCESSING = "preprocessing"
VISION_ENCODER = "vision_encoder"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
TENSORRT_LLM_BLS = "tensorrt_llm_bls"
# The models of one build besides its ensemble, in ModelNames' field order.
MEMBERS = (PREPROCESSING, VISION_ENCODER, TENSORRT_LLM, POSTPROCESSING, TENSORRT_LLM_BLS)


@dataclass(frozen=True)
class ModelNames:
    """Names of one build's models in a repository. An unnamed build uses the upstream names
    (`ensemble`, `preprocessing`, ...); a named build `NAME` (several builds in one
    repository) uses `NAME` for its ensemble and `NAME_<step>` for its steps."""

    ensemble: str = ENSEMBLE
    preprocessing: str = PREPROCESSING
    vision_encoder: str = VISION_ENCODER
    tensorrt_llm: str = TENSORRT_LLM
    postprocessing: str = POSTPROCESSING
    tensorrt_llm_bls: str = TENSORRT_LLM_BLS

    @classmethod
    def for_build(cls, name: str | None) -> ModelNames:
        if not name:
            return cls()
        return cls(name, *(f"{name}_{member}" for member in MEMBERS))

    def all(self) -> tuple[str, ...]:
        """Every model of the build, the ensemble first."""
        return (self.ensemble, self.preprocessing, self.vision_encoder, self.tensorrt_llm,
                self.postprocessing, self.tensorrt_llm_bls)


# ---- the python models' metrics on Triton's /metrics -------------------------------------
# postprocessing's admission (runtime/postprocessing.py QueueMetrics), labelled model and
# instance; the vision cache (runtime/vision_encoder.py), labelled model.
LLM_REQUESTS_WAITING = "qvl_llm_requests_waiting"
LLM_REQUESTS_RUNNING = "qvl_llm_requests_running"
LLM_QUEUE_WAIT = "qvl_llm_queue_wait_seconds"  # a histogram
LLM_REQUESTS_REFUSED = "qvl_llm_requests_refused_total"  # label reason
VISION_CACHE_HITS = "qvl_vision_cache_hits_total"
VISION_CACHE_MISSES = "qvl_vision_cache_misses_total"
VISION_CACHE_BYTES = "qvl_vision_cache_bytes"


# ---- python models' parameters -----------------------------------------------------------
# One frozen dataclass per python model: the repository writer sets `to_parameters()` in its
# config, its model.py (and the client, serve and validate) read `from_parameters(...)`, so a
# parameter has one name and one type from the profile's limits to the model that uses them.


class ModelParameters:
    def to_parameters(self) -> dict[str, str | int | float | bool]:
        """The model config's parameters (`pbconfig.set_parameters` makes them strings)."""
        return to_parameters(self)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], where: str = "") -> Any:
        """From the model config's parameters (string values); a ConfigError names a missing,
        unknown or mistyped key."""
        return load_parameters(cls, params, where or f"{cls.__name__}")


@dataclass(frozen=True)
class PreprocessingParameters(ModelParameters):
    """The deployment's per-request limits (the names of mm.request.RequestLimits; the profile
    calls them limits.max_images_per_request, .max_input_len, .max_seq_len,
    .vision_min_pixels, .vision_max_pixels, .max_visual_tokens_per_request) and defaults."""

    max_images: int
    max_input_len: int
    max_seq_len: int
    min_pixels: int
    max_pixels: int
    max_visual_tokens: int
    default_max_tokens: int
    # mm.request.RequestBounds, field for field (the repository writes its defaults).
    max_request_bytes: int
    max_messages: int
    max_content_parts: int
    max_text_bytes: int
    max_stop_words: int
    max_stop_bytes: int
    max_stop_tokens: int
    # mm.video.VideoLimits, field for field.
    max_videos: int
    max_video_frames: int
    max_video_seconds: float
    max_video_frame_pixels: int
    max_video_tokens: int
    image_url_allow_list: str = ""  # comma-separated hosts remote image and video URLs may name
    # The checkpoint folder's name (e.g. Qwen3-VL-2B-Instruct): the gateway's `root` of the
    # model, and a model id it takes.
    checkpoint_name: str = ""
    # The OpenAI model name this build is served under together with the other builds of its
    # checkpoint that have it (triton/repository.py _served_names says which); empty: served
    # alone, by its ensemble's name.
    served_name: str = ""
    # The build's manifest cache key (its inputs by content, as build.json names it): with
    # the other configs, what tells the gateway's answer cache one build from another.
    cache_key: str = ""


@dataclass(frozen=True)
class VisionEncoderParameters(ModelParameters):
    flavor: Flavor
    device: str  # reference flavor: "auto" (cuda when present), "cpu", "cuda:0", ...
    dtype: str  # reference flavor: the tower's precision
    cache_bytes: int  # the row cache's budget


@dataclass(frozen=True)
class ReferenceLlmParameters(ModelParameters):
    """The reference flavor's tensorrt_llm model."""

    device: str
    dtype: str  # the decoder's precision, and the prompt table's
    # max_prompt_embedding_table_size / max_batch_size: the stand-in refuses bigger tables,
    # as the executor does.
    prompt_table_rows_per_request: int
    # The stock backend's parameter of this name: how often a request's cancel flag is polled.
    cancellation_check_period_ms: int
    # The stock backend's parameters of these names: guided decoding is on when both are set
    # (xgrammar, and the tokenizer info file, relative to the model's version folder).
    guided_decoding_backend: str = ""
    xgrammar_tokenizer_info_path: str = ""
    # The stock backend's parameter: prefill contexts longer than the engine's max_num_tokens
    # in chunks; without it the executor refuses them. Absent means false, as the backend
    # reads it (model_instance_state.cc getExecutorConfigFromParams).
    enable_chunked_context: bool = False
    # The stock backend's parameter: reuse the KV blocks of a prompt prefix another request
    # computed, matched on (token id, prompt_table_extra_id) block by block (the reference
    # counts them: runtime/block_reuse.py). Absent means false, as the backend reads it.
    enable_kv_cache_reuse: bool = False

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], where: str = "") -> Any:
        """The backend's booleans (enable_chunked_context, enable_kv_cache_reuse) are read as
        it reads them (True/true/TRUE/1, ...); one it cannot read is refused here, where the
        backend would run with the feature off."""
        where = where or cls.__name__
        for name in ("enable_chunked_context", "enable_kv_cache_reuse"):
            text = params.get(name)
            if text is None:
                continue
            value = parse_bool(text)
            if value is None:
                raise ConfigError(f"{where}.{name}: Cannot convert {text!r} to a boolean; write "
                                  f"one of {'/'.join(BACKEND_TRUE)} or {'/'.join(BACKEND_FALSE)}")
            params = {**params, name: str(value).lower()}
        return load_parameters(cls, params, where)


@dataclass(frozen=True)
class PostprocessingParameters(ModelParameters):
    tensorrt_llm_model: str  # the model it runs by BLS
    # tensorrt_llm's admission (runtime/admission.py), shared by every caller of it: its
    # max_batch_size, the requests that may wait for a slot beyond them, and how long one may
    # wait (0: as long as it takes).
    batch_slots: int
    max_queue: int
    max_queue_wait_s: float
    # The MRoPE table it builds before each call (mm.rope.MropeTable): the engine's positions
    # (max_position_embeddings = the profile's limits.max_seq_len) and the checkpoint's
    # rotary settings. A client that calls tensorrt_llm itself (`qvl-trt verify`) reads them
    # here to build the same table.
    max_seq_len: int
    head_dim: int
    rope_theta: float
    mrope_section: str  # T,H,W frequency slots, e.g. "24,20,20"
    mrope_interleaved: bool

    @property
    def capacity(self) -> int:
        """The requests the build admits at once: its batch slots and its queue's places."""
        return self.batch_slots + self.max_queue

    @property
    def workers(self) -> int:
        """Worker threads per instance, each holding one admitted request (any instance may
        hold every place, and the probe); the server sizes the python backend's BLS
        thread-pool-size from their sum."""
        return self.capacity + 1

    @staticmethod
    def mrope_fields(table: MropeTable) -> dict[str, Any]:
        """The MRoPE settings as this dataclass's fields."""
        return {"max_seq_len": table.max_positions, "head_dim": table.head_dim,
                "rope_theta": table.rope_theta, "mrope_interleaved": table.mrope_interleaved,
                "mrope_section": ",".join(str(s) for s in table.mrope_section)}

    def mrope_table(self) -> MropeTable:
        from ..mm.rope import MropeTable

        try:
            section = tuple(int(s) for s in self.mrope_section.split(","))
        except ValueError:
            section = ()
        if len(section) != 3 or sum(section) * 2 != self.head_dim:
            raise ConfigError(f"mrope_section {self.mrope_section!r} is not three slot counts "
                              f"summing to head_dim / 2 = {self.head_dim // 2}; regenerate "
                              "the repository with `qvl-trt repo`")
        return MropeTable(self.head_dim, self.rope_theta, section, self.mrope_interleaved,
                          self.max_seq_len)


@dataclass(frozen=True)
class TensorrtLlmBlsParameters(PostprocessingParameters):
    """Postprocessing's, and the steps it runs before it."""

    preprocessing_model: str
    vision_encoder_model: str


def llm_caller_parameters(params: Mapping[str, str],
                          where: str) -> PostprocessingParameters | None:
    """The parameters of a model that runs tensorrt_llm by BLS (tensorrt_llm_bls, which names
    the steps it runs first, or postprocessing), or None for another model."""
    if "preprocessing_model" in params:
        return TensorrtLlmBlsParameters.from_parameters(params, where)
    if "tensorrt_llm_model" in params:
        return PostprocessingParameters.from_parameters(params, where)
    return None


def config_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """The parameters of a model config in Triton's JSON form (all string values)."""
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


# ---- tensor specs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # "INT32", "FP16", "BYTES", ... (Triton's TYPE_* without the prefix)
    dims: tuple[int, ...]  # without the batch dimension; -1 is dynamic
    optional: bool = False
    # Scalars the tensorrtllm backend reads as shape [] per batch row.
    reshape: tuple[int, ...] | None = None
    ragged: bool = False  # allow_ragged_batch: rows of different lengths in one batch


def _scalar(name: str, data_type: str, *, optional: bool = False,
            reshape: bool = False) -> TensorSpec:
    return TensorSpec(name, data_type, (1,), optional, () if reshape else None)


# ---- the ensemble's public I/O ------------------------------------------------------------

MESSAGES = "messages"  # JSON chat (OpenAI-style content parts, video parts too), UTF-8
# With messages: the functions the chat template lists for the model to call, as JSON (OpenAI's
# `tools`: [{"type": "function", "function": {"name", "description", "parameters"}}, ...]).
TOOLS = "tools"
TEXT_INPUT = "text_input"  # a plain question (with image_bytes and videos: one user turn)
IMAGE_BYTES = "image_bytes"  # encoded images (JPEG/PNG/WebP/...) or data: URIs, one per element
# With text_input. Video files (MP4, WebM, MKV, ...) or their data: URIs, one per element.
VIDEO_BYTES = "video_bytes"
# With text_input. Videos sent as frames: the encoded frames of every such video one after
# another, and how many belong to each (absent: all of them to one video).
VIDEO_FRAMES = "video_frames"
VIDEO_FRAME_COUNTS = "video_frame_counts"
# One rate for every video, or one per video (files first, then frame lists): a file is
# sampled at this many frames per second; a frame list was taken at this rate.
VIDEO_FPS = "video_fps"
MAX_TOKENS = "max_tokens"
# The end token is not chosen before this many tokens (the stock backend's input of the name:
# TensorRT-LLM masks the request's end id until then, kernels/penaltyKernels.cu).
MIN_TOKENS = "min_tokens"
# True: no end token ends the answer (vLLM's ignore_eos): tensorrt_llm gets end_id NO_END_ID
# and the checkpoint's other end tokens are no stop words; max_tokens or a stop string ends it.
IGNORE_EOS = "ignore_eos"
TEMPERATURE = "temperature"  # 0 means greedy
TOP_P = "top_p"
TOP_K = "top_k"
SEED = "seed"
STOP = "stop"  # stop strings
STREAM = "stream"
# Guided decoding (structured output), the stock backend's inputs of these names, passed to
# tensorrt_llm unchanged: the guide's type (json, json_schema, regex, ebnf_grammar:
# llm.guided.GuideType) and the guide (a JSON schema, a regex, an EBNF grammar; none for
# json). The answer then takes that structure, and ends when it is complete.
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"
GUIDED_DECODING_GUIDE = "guided_decoding_guide"
# True: a liveness probe (serve's supervisor sends them): a one-token text request that does
# not queue behind other requests for a batch slot but goes to tensorrt_llm at once and takes
# the next slot that frees; one at a time per build (runtime/admission.py).
HEALTH_PROBE = "health_probe"
# Whose caches the request may use: the vision cache's rows and tensorrt_llm's reused KV blocks
# are keyed by it (the gateway sends the tenant's scope; absent or empty: the one shared
# scope). Preprocessing folds it into the image hashes and every prompt_table_extra_id
# (mm/prompt_table.py scope_ids), so two scopes never share a cached image or a KV block.
CACHE_SCOPE = "cache_scope"
MAX_CACHE_SCOPE_BYTES = 256
TEXT_OUTPUT = "text_output"  # streamed deltas when stream=true, the whole answer otherwise;
# without a final stop string (its tokens still count in completion_tokens)
PROMPT_TOKENS = "prompt_tokens"  # tokens in the prompt, visual tokens included
COMPLETION_TOKENS = "completion_tokens"  # tokens generated so far
# Of prompt_tokens, the images' and the videos' visual tokens at their budgets. A repository
# written before they existed answers without them (clients then report no details).
IMAGE_TOKENS = "image_tokens"
VIDEO_TOKENS = "video_tokens"
# Their names in the gateway's usage.prompt_tokens_details too (docs/openai.md).
MEDIA_TOKEN_OUTPUTS = (IMAGE_TOKENS, VIDEO_TOKENS)
# Why the answer ended, in its final response ("" before): "stop" (the end token or a stop
# string, which the answer leaves out) or "length" (max_tokens, or the engine's room, reached).
FINISH_REASON = "finish_reason"

# TYPE_STRING [1], optional, as the stock backend's tensorrt_llm config declares them.
GUIDE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(GUIDED_DECODING_GUIDE_TYPE, "BYTES", (1,), optional=True),
    TensorSpec(GUIDED_DECODING_GUIDE, "BYTES", (1,), optional=True),
)
HEALTH_PROBE_INPUT = _scalar(HEALTH_PROBE, "BOOL", optional=True)
ENSEMBLE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(MESSAGES, "BYTES", (1,), optional=True),
    TensorSpec(TOOLS, "BYTES", (1,), optional=True),
    TensorSpec(TEXT_INPUT, "BYTES", (1,), optional=True),
    TensorSpec(IMAGE_BYTES, "BYTES", (-1,), optional=True),
    TensorSpec(VIDEO_BYTES, "BYTES", (-1,), optional=True),
    TensorSpec(VIDEO_FRAMES, "BYTES", (-1,), optional=True),
    TensorSpec(VIDEO_FRAME_COUNTS, "INT32", (-1,), optional=True),
    TensorSpec(VIDEO_FPS, "FP32", (-1,), optional=True),
    _scalar(MAX_TOKENS, "INT32", optional=True),
    _scalar(MIN_TOKENS, "INT32", optional=True),
    _scalar(IGNORE_EOS, "BOOL", optional=True),
    _scalar(TEMPERATURE, "FP32", optional=True),
    _scalar(TOP_P, "FP32", optional=True),
    _scalar(TOP_K, "INT32", optional=True),
    _scalar(SEED, "UINT64", optional=True),
    TensorSpec(STOP, "BYTES", (-1,), optional=True),
    _scalar(STREAM, "BOOL", optional=True),
    *GUIDE_INPUTS,
    HEALTH_PROBE_INPUT,
    TensorSpec(CACHE_SCOPE, "BYTES", (1,), optional=True),
)
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
# The integer settings' ranges: from the least the deployment takes to the most the input's
# type holds. The gateway declares its fields with them (gateway/openai_api.py FIELDS).
SETTING_RANGES: Mapping[str, tuple[int, int]] = {
    MAX_TOKENS: (1, INT32_MAX), MIN_TOKENS: (0, INT32_MAX), SEED: (0, UINT64_MAX)}


def check_range(name: str, value: int, low: int, high: int) -> None:
    """Refuse (FieldError) an integer setting outside [low, high] (SETTING_RANGES')."""
    if not low <= value <= high:
        raise FieldError(f"{name} = {value} must be from {low} to {high}", name)


def check_min_tokens(min_tokens: int, max_tokens: int, *, defaulted: bool = False) -> None:
    """min_tokens may not exceed max_tokens (`defaulted`: the deployment's default, the
    request left max_tokens out)."""
    if min_tokens > max_tokens:
        default = " (the deployment's default where max_tokens is left out)" * defaulted
        raise FieldError(f"{MIN_TOKENS} = {min_tokens} is above {MAX_TOKENS} = {max_tokens}"
                         f"{default}; send {MIN_TOKENS} <= {MAX_TOKENS}", MIN_TOKENS)


ENSEMBLE_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(TEXT_OUTPUT, "BYTES", (1,)),
    _scalar(PROMPT_TOKENS, "INT32"),
    _scalar(COMPLETION_TOKENS, "INT32"),
    TensorSpec(FINISH_REASON, "BYTES", (1,)),
    _scalar(IMAGE_TOKENS, "INT32"),
    _scalar(VIDEO_TOKENS, "INT32"),
)


@dataclass(frozen=True)
class EnsembleRequest:
    """One request to the ensemble's public inputs (and tensorrt_llm_bls', the same), typed;
    the fields are the inputs by name. The one encoder of every client (`to_tensors`, with
    the contract's data types) and the one reader of the python models (`from_row`). None
    and () are absent inputs: the deployment's defaults apply."""

    messages: str | None = None  # the chat as JSON
    tools: str | None = None  # the functions offered, as JSON
    text_input: str | None = None
    image_bytes: tuple[bytes, ...] = ()
    video_bytes: tuple[bytes, ...] = ()
    video_frames: tuple[bytes, ...] = ()
    video_frame_counts: tuple[int, ...] | None = None
    video_fps: tuple[float, ...] = ()
    max_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool | None = None
    guided_decoding_guide_type: str | None = None
    guided_decoding_guide: str | None = None
    health_probe: bool | None = None
    cache_scope: str | None = None

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Input name -> value with the batch dimension of one row, for the inputs present."""
        tensors = {}
        for spec in ENSEMBLE_INPUTS:
            value = getattr(self, spec.name)
            if value is None or value == ():
                continue
            row = [value] if spec.dims == (1,) else list(value)
            if spec.data_type == "BYTES":
                row = [text_bytes(v, spec.name if spec.dims == (1,) else f"{spec.name}[{i}]")
                       if isinstance(v, str) else v for i, v in enumerate(row)]
            elif spec.data_type == "FP32":
                row = [fp32(v, spec.name) for v in row]
            tensors[spec.name] = np.array([row], _NUMPY_TYPES[spec.data_type])
        return tensors

    def infer_inputs(self, infer_input: Callable[[str, list[int], str], Any]) -> list[Any]:
        """tritonclient's inputs of the request (`infer_input`: its grpc module's
        InferInput)."""
        inputs = []
        for name, value in self.to_tensors().items():
            tensor = infer_input(name, list(value.shape), _ENSEMBLE_TYPES[name])
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return inputs

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> EnsembleRequest:
        """From one batch row of the inputs (name -> value: [1]-shaped ones unwrapped, absent
        ones missing); an InputError names an input that is not UTF-8 text."""
        values: dict[str, Any] = {}
        for spec in ENSEMBLE_INPUTS:
            value = row.get(spec.name)
            if value is None:
                continue
            cast = _FROM_WIRE[spec.data_type]
            if spec.name in _TEXTS:
                cast = partial(utf8, name=spec.name)
            values[spec.name] = cast(value) if spec.dims == (1,) else tuple(map(cast, value))
        return cls(**values)

    def payload_bytes(self) -> int:
        """Bytes of the BYTES inputs as sent (their UTF-8 size for texts)."""
        return sum(len(v.encode()) if isinstance(v, str) else len(v)
                   for spec in ENSEMBLE_INPUTS if spec.data_type == "BYTES"
                   for v in _elements(getattr(self, spec.name)))


def text_bytes(text: str, name: str) -> bytes:
    """`text` as UTF-8; an InputError names the input (or the JSON field) holding a lone
    surrogate, which UTF-8 cannot encode (JSON can spell one: "\\ud800")."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise InputError(f"{name} holds a lone surrogate (U+{ord(text[exc.start]):04X} at "
                         f"character {exc.start}), which is not Unicode text; send it with "
                         "its pair or without it") from None


FP32_MAX = float(np.finfo(np.float32).max)


def fp32(value: float, name: str) -> float:
    """A number for an FP32 input; a FieldError names one float32 cannot hold (its cast
    would be inf)."""
    if not abs(value) <= FP32_MAX:
        raise FieldError(f"{name} = {value:g} is beyond float32 (at most {FP32_MAX:.7g}), the "
                         "type the deployment takes it in; send a smaller number", name)
    return value


def _elements(value: Any) -> tuple[Any, ...]:
    return () if value is None else value if isinstance(value, tuple) else (value,)


def utf8(value: Any, name: str) -> str:
    """A BYTES element as text; an InputError names the input that is not UTF-8."""
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "send UTF-8") from None


# Triton's data types as numpy's (BYTES: Python bytes in an object array), and as the Python
# values a row's elements are read as.
_NUMPY_TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64,
                "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32, "BYTES": np.object_}
_FROM_WIRE: Mapping[str, Callable[[Any], Any]] = {
    "BOOL": bool, "INT32": int, "UINT64": int, "FP32": float, "BYTES": bytes}
_ENSEMBLE_TYPES = {s.name: s.data_type for s in ENSEMBLE_INPUTS}
# BYTES inputs that hold UTF-8 text
_TEXTS = frozenset((MESSAGES, TOOLS, TEXT_INPUT, STOP, GUIDED_DECODING_GUIDE_TYPE,
                    GUIDED_DECODING_GUIDE, CACHE_SCOPE))
ENSEMBLE_BYTES_INPUTS = tuple(s.name for s in ENSEMBLE_INPUTS if s.data_type == "BYTES")


# ---- JSON inputs ---------------------------------------------------------------------------
# The deepest nesting of JSON arrays and objects a request may have (a value itself is level
# 1), checked where the JSON enters: the gateway's body, the ensemble's messages and tools.
# Later steps walk messages and schemas recursively (the chat template's tojson, xgrammar's
# converter); no chat request needs more (OpenAI's structured outputs allow 10 levels of
# schema nesting).
MAX_JSON_DEPTH = 64


def too_deep(where: str) -> InputError:
    shown = where if len(where) <= 80 else f"{where[:80]}..."
    return InputError(f"{shown} nests JSON arrays and objects more than {MAX_JSON_DEPTH} "
                      "levels deep, the most a request may; send a flatter value")


def check_depth(value: Any, name: str = "") -> None:
    """Refuse (InputError) a value with an array or object nested deeper than MAX_JSON_DEPTH,
    naming the first such field (`name` is the value's: messages, tools[0]...). Walked without
    recursion."""
    todo: list[tuple[str, Any, int]] = [(name, value, 1)]
    while todo:
        path, node, depth = todo.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(path.lstrip(".") or "the value")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        todo += ((f"{path}.{k}" if isinstance(node, dict) else f"{path}[{k}]", v, depth + 1)
                 for k, v in items)


# ---- error responses ----------------------------------------------------------------------
# An error response of a python model reaches its client as text only (Triton's gRPC stream
# carries no usable error code: a python TritonError is INTERNAL unless its model says
# otherwise, and a BLS call resets it to INTERNAL), so each kind of failure writes its marker
# at the START of the text, before any of the request's own words: the python models mark by
# exception class (runtime/backend.py error_message) and a model that passes another's error
# on puts that error's marker first again (`ErrorKind.relay`). A client reads the kind from
# the start alone (`ErrorKind.of_message`), past the one prefix Triton adds (an ensemble's,
# core ensemble_scheduler.cc: "in ensemble 'NAME', "), so text a client sent (a role, a tool
# name, a schema's keys) can never decide the kind.

class ErrorKind(enum.Enum):
    """The kinds of failure, each by the marker it writes in front of the message."""

    REQUEST = "invalid request: "  # the request's to fix (a QvlError)
    LIMIT = "over a deployment limit: "  # a LimitError: the request is too large
    # An EngineLimitError: above what this build was sized for; a build of the same
    # checkpoint with larger limits may take it (the gateway tries it: gateway/routing.py).
    ENGINE_LIMIT = "over the engine's limits: "
    UNAVAILABLE = "unavailable: "  # an UnavailableError: not now, try again later
    BUSY = "busy: "  # a BusyError: every batch slot and queue place is taken; try again later
    INTERNAL = "internal error in "  # a bug: the model's name and the exception type follow

    def mark(self, text: str) -> str:
        return f"{self.value}{text}"

    @classmethod
    def of_error(cls, exc: BaseException) -> ErrorKind:
        if isinstance(exc, LimitError):
            return cls.LIMIT
        if isinstance(exc, EngineLimitError):
            return cls.ENGINE_LIMIT
        if isinstance(exc, BusyError):
            return cls.BUSY
        if isinstance(exc, UnavailableError):
            return cls.UNAVAILABLE
        return cls.REQUEST if isinstance(exc, QvlError) else cls.INTERNAL

    @classmethod
    def split(cls, message: str) -> tuple[ErrorKind, str]:
        """(the kind, the text after Triton's ensemble prefix and the marker). Text without a
        marker is Triton's own or the stock tensorrt_llm backend's: a model that is not there
        now (TRITON_UNAVAILABLE, matched at the start), else the request's to fix."""
        body = _ENSEMBLE_PREFIX.sub("", message, count=1)
        for kind in cls:
            if body.startswith(kind.value):
                return kind, body[len(kind.value):]
        if TRITON_UNAVAILABLE.match(body):
            return cls.UNAVAILABLE, body
        return cls.REQUEST, body

    @classmethod
    def of_message(cls, message: str) -> ErrorKind:
        """The kind an error response's text carries (see the section's comment)."""
        return cls.split(message)[0]

    @classmethod
    def relay(cls, message: str, step: str) -> str:
        """Another model's error response as this one passes it on: its kind's marker first,
        then the step's name and its text (which says what failed there)."""
        kind, body = cls.split(message)
        return kind.mark(f"{step}: {body}")


# Triton's prefix on an ensemble step's error (core ensemble_scheduler.cc: "in ensemble '" +
# ensemble_name + "', " + message), once.
_ENSEMBLE_PREFIX = re.compile(r"in ensemble '[^']*', ")
# Triton's own texts, at the start of the message, for a model that is not there right now: a
# python stub that died (python_backend stub_launcher.cc, python_be.cc; serve restarts the
# server), a model not ready or gone while Triton reloads (request_executor.cc for a BLS
# call, model_repository_manager.cc), a server that is stopping.
TRITON_UNAVAILABLE = re.compile(
    r"(?:Failed to process the request\(s\) for model (?:instance )?'[^']*', message: )?"
    r"(?:Stub process (?:'[^']*' )?is not healthy\."
    r"|Failed for execute the inference request\. Model '[^']*' is not ready\."
    r"|Request for unknown model: "
    r"|model '[^']*'(?:, version \S+)? is not (?:ready|at ready state|found)"
    r"|Server not ready|Server exiting|Server is stopping)")

# ---- tensors between the steps ------------------------------------------------------------

# tensorrt_llm inputs (stock backend names)
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
REQUEST_OUTPUT_LEN = "request_output_len"
END_ID = "end_id"
# No end id: what the batch manager makes of a request without one (its end_id input is
# optional: createNewDecoderRequests.cpp, `mEndId.value_or(-1)`); no generated token equals it.
NO_END_ID = -1
PAD_ID = "pad_id"
STREAMING = "streaming"
RUNTIME_TOP_K = "runtime_top_k"
RUNTIME_TOP_P = "runtime_top_p"
# TEMPERATURE and SEED: the backend's names equal the public ones.
STOP_WORDS_LIST = "stop_words_list"
PROMPT_EMBEDDING_TABLE = "prompt_embedding_table"
PROMPT_TABLE_EXTRA_IDS = "prompt_table_extra_ids"
PROMPT_VOCAB_SIZE = "prompt_vocab_size"
MROPE_ROTARY_COS_SIN = "mrope_rotary_cos_sin"
MROPE_POSITION_DELTAS = "mrope_position_deltas"
# The stock backend's stop request (handleStopRequest): `stop=true` with the request_id of a
# running request cancels it. Not the public STOP (stop strings), which is never forwarded.
STOP_REQUEST = "stop"
# tensorrt_llm outputs
OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
# preprocessing -> vision_encoder
# One vision item is an image or one temporal group (two consecutive frames) of a video: the
# tower attends within an item, so vision_encoder runs and caches item by item.
# uint8 patch rows (channel, temporal frame, y, x) of every item of the request, in prompt
# order; the vision tower rescales and normalises them itself (qvl_trt/mm/pixels.py)
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"  # (1, h, w) patches per item; 0 rows for text-only
# 64-bit content hash per item, within the request's cache scope: cache key and KV-reuse id
IMAGE_HASHES = "image_hashes"
# preprocessing -> the step that calls tensorrt_llm (postprocessing, tensorrt_llm_bls): the
# prompt's T/H/W positions [3, seq], from which that step builds mrope_rotary_cos_sin right
# before the call (runtime/llm_inputs.py). The table is max_seq_len x head_dim float32 (4 MiB
# at 8192 x 128) and the stock backend needs it on every request; the ids are 24 bytes a token.
MROPE_POSITION_IDS = "mrope_position_ids"
# preprocessing -> the caller of tensorrt_llm: [image tokens, video tokens] of the prompt,
# which that caller answers as IMAGE_TOKENS and VIDEO_TOKENS (an ensemble step may not make
# a public output another step makes too, hence one internal tensor of its own).
MEDIA_TOKENS = "media_tokens"

LLM_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(INPUT_IDS, "INT32", (-1,), ragged=True),
    _scalar(INPUT_LENGTHS, "INT32", reshape=True),
    _scalar(REQUEST_OUTPUT_LEN, "INT32", reshape=True),
    _scalar(END_ID, "INT32", optional=True, reshape=True),
    _scalar(PAD_ID, "INT32", optional=True, reshape=True),
    _scalar(STREAMING, "BOOL", optional=True, reshape=True),
    _scalar(MIN_TOKENS, "INT32", optional=True, reshape=True),
    _scalar(TEMPERATURE, "FP32", optional=True, reshape=True),
    _scalar(RUNTIME_TOP_K, "INT32", optional=True, reshape=True),
    _scalar(RUNTIME_TOP_P, "FP32", optional=True, reshape=True),
    _scalar(SEED, "UINT64", optional=True, reshape=True),
    TensorSpec(STOP_WORDS_LIST, "INT32", (2, -1), optional=True, ragged=True),
    # FP16 for float16 engines; the repository emitter sets the build's dtype.
    TensorSpec(PROMPT_EMBEDDING_TABLE, "FP16", (-1, -1), optional=True, ragged=True),
    TensorSpec(PROMPT_TABLE_EXTRA_IDS, "UINT64", (-1,), optional=True, ragged=True),
    _scalar(PROMPT_VOCAB_SIZE, "INT32", optional=True, reshape=True),
    TensorSpec(MROPE_ROTARY_COS_SIN, "FP32", (-1,), optional=True),
    _scalar(MROPE_POSITION_DELTAS, "INT64", optional=True),
    _scalar(STOP_REQUEST, "BOOL", optional=True, reshape=True),
    *GUIDE_INPUTS,
)
LLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(OUTPUT_IDS, "INT32", (-1, -1)),  # (beam, tokens); new tokens only when streaming
    TensorSpec(SEQUENCE_LENGTH, "INT32", (-1,)),
)

PREPROCESSING_INPUTS = ENSEMBLE_INPUTS
PREPROCESSING_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(INPUT_IDS, "INT32", (-1,)),
    _scalar(INPUT_LENGTHS, "INT32"),
    _scalar(REQUEST_OUTPUT_LEN, "INT32"),
    _scalar(END_ID, "INT32"),
    _scalar(PAD_ID, "INT32"),
    _scalar(STREAMING, "BOOL"),
    _scalar(MIN_TOKENS, "INT32"),
    _scalar(TEMPERATURE, "FP32"),
    _scalar(RUNTIME_TOP_K, "INT32"),
    _scalar(RUNTIME_TOP_P, "FP32"),
    _scalar(SEED, "UINT64"),
    TensorSpec(STOP_WORDS_LIST, "INT32", (2, -1)),
    TensorSpec(PROMPT_TABLE_EXTRA_IDS, "UINT64", (-1,)),
    TensorSpec(MROPE_POSITION_IDS, "INT64", (3, -1)),
    _scalar(MROPE_POSITION_DELTAS, "INT64"),
    TensorSpec(PIXEL_VALUES, "UINT8", (-1, -1)),  # (patches, C*T*P*P)
    TensorSpec(IMAGE_GRID_THW, "INT64", (-1, 3)),
    TensorSpec(IMAGE_HASHES, "UINT64", (-1,)),
    TensorSpec(MEDIA_TOKENS, "INT32", (2,)),
)

VISION_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(PIXEL_VALUES, "UINT8", (-1, -1)),
    TensorSpec(IMAGE_GRID_THW, "INT64", (-1, 3)),
    TensorSpec(IMAGE_HASHES, "UINT64", (-1,)),
)
VISION_OUTPUTS: tuple[TensorSpec, ...] = (
    # (1+K) rows of width hidden_size per visual token (main + K DeepStack rows); one zero
    # row for a text-only request, which no input id references.
    TensorSpec(PROMPT_EMBEDDING_TABLE, "FP16", (-1, -1)),
    _scalar(PROMPT_VOCAB_SIZE, "INT32"),
)

# postprocessing drives tensorrt_llm: it receives every tensorrt_llm input the earlier steps
# make, builds the MRoPE table from the position ids, forwards them (BLS, streaming) and turns
# the token responses into text. An ensemble cannot do that hop itself: a step after a
# decoupled step may only read that step's outputs ("receives inputs originated from
# different decoupled models"), and the text of a stream needs per-request state that only
# the request's own caller holds.
# What the caller of tensorrt_llm builds before the call, and from which of its inputs.
BUILT_FOR_LLM: Mapping[str, str] = {MROPE_ROTARY_COS_SIN: MROPE_POSITION_IDS}
_LLM_INPUT_NAMES = frozenset(s.name for s in LLM_INPUTS)
# The guide and the probe flag come from the ensemble's own inputs (FROM_PUBLIC):
# preprocessing checks them, the caller of tensorrt_llm passes the guide on unchanged and
# admits a probe ahead of the queue.
POSTPROCESSING_INPUTS: tuple[TensorSpec, ...] = tuple(
    s for s in PREPROCESSING_OUTPUTS + VISION_OUTPUTS
    if s.name in _LLM_INPUT_NAMES or s.name in BUILT_FOR_LLM.values()
    or s.name == MEDIA_TOKENS) + GUIDE_INPUTS + (HEALTH_PROBE_INPUT,)
FROM_PUBLIC = frozenset(s.name for s in (*GUIDE_INPUTS, HEALTH_PROBE_INPUT))
# What the caller of tensorrt_llm reads itself and does not pass on.
TAKEN_BY_CALLER = frozenset((HEALTH_PROBE, MEDIA_TOKENS))
POSTPROCESSING_OUTPUTS = ENSEMBLE_OUTPUTS


# ---- TensorRT-LLM's word-list tensor (stop_words_list) ----------------------------------

def stop_words_list(sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """TensorRT-LLM's word-list tensor [2, L]: row 0 the token ids of all sequences one after
    another, row 1 the end offset of each sequence; padded with 0 / -1 (at least one column,
    so an empty list is [[0], [-1]])."""
    flat = [int(t) for seq in sequences for t in seq]
    offsets = np.cumsum([len(seq) for seq in sequences]).tolist()
    width = max(1, len(flat), len(offsets))
    out = np.zeros((2, width), np.int32)
    out[1, :] = -1
    out[0, : len(flat)] = flat
    out[1, : len(offsets)] = offsets
    return out


def word_list_sequences(word_list: np.ndarray) -> list[list[int]]:
    """Inverse of stop_words_list: the token sequences of a [2, L] word list, refused (one
    InputError naming the fault) where the stock backend refuses it: its convertWordList
    (TensorRT-LLM triton_backend/inflight_batcher_llm/src/utils.cc) reads the end offsets up
    to the first -1 and throws on an offset past the L ids, a non-increasing offset or a
    value after the -1 padding. Stricter than it: the shape must be [2, L] (Triton's dims for
    the input; the backend only flattens it), and an empty first word (offset 0 or below),
    which the backend passes on, is refused too."""
    array = np.asarray(word_list)
    if array.ndim != 2 or array.shape[0] != 2:
        raise InputError(f"stop_words_list has shape {list(array.shape)}; send [2, L]: the "
                         "token ids of all words, then each word's end offset padded with -1")
    flat, offsets = (row.tolist() for row in array)
    ends: list[int] = []
    for i, end in enumerate(offsets):
        if end == -1:
            if any(o != -1 for o in offsets[i:]):
                raise InputError(f"stop_words_list offsets {offsets} go on after the -1 "
                                 "padding; pad the end offsets with -1 only at the end")
            break
        if end > len(flat):
            raise InputError(f"stop_words_list offset {end} is past its {len(flat)} token ids; "
                             "each offset ends a word within row 0")
        if end <= (ends[-1] if ends else 0):
            raise InputError(f"stop_words_list offsets {offsets} do not increase (an empty "
                             "stop word); give each word's end offset, cumulative")
        ends.append(end)
    starts = [0, *ends][: len(ends)]
    return [flat[a:b] for a, b in zip(starts, ends, strict=True)]
