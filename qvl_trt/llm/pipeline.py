"""The in-process reference pipeline: messages + images -> text, without Triton.

qvl_trt.mm preprocessing (the Triton preprocessing model's code) -> the export-friendly vision
tower (the vision engine's PyTorch twin) -> the (1+K)-row prompt table -> the reference
decoder on a converted TensorRT-LLM checkpoint -> detokenization. Every tensor between the
steps is the one the engines receive.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..chat_messages import VideoInput, user_message
from ..checkpoint import Checkpoint, open_checkpoint
from ..deps import require
from ..dtypes import Dtype, pick
from ..errors import CheckpointError, InputError
from ..mm.detokenizer import StreamDecoder, TokenBytes
from ..mm.request import ImageInput, PreparedRequest, RequestLimits, RequestPreprocessor
from ..vision.cache import RowCache
from ..vision.step import VisionStep, reference_tower
from .layout import DTYPES, LlmConfig, read_llm_config
from .sampling import DecodeRequest, FinishReason, SamplingParams


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    image_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class TextDelta:
    """One streamed token and the text it completes (empty while a character is split; the
    last one flushes an unfinished character as U+FFFD, as a one-shot decode does)."""

    token_id: int
    text: str


def sampling_params(model: str | Path, *, max_tokens: int, greedy: bool = False,
                    temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None) -> SamplingParams:
    """Greedy, or the options given over the checkpoint's sampling defaults
    (`GenerationConfig.sampling_defaults`: greedy unless its do_sample is true), as the
    served preprocessing fills a request's settings."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if greedy:
        if any(v is not None for v in given.values()):
            raise InputError("--greedy takes no --temperature, --top-k or --top-p")
        return SamplingParams(max_tokens=max_tokens, greedy=True, seed=seed)
    defaults = open_checkpoint(model, validate=False).generation.sampling_defaults()
    return SamplingParams(max_tokens=max_tokens, seed=seed, **{
        k: getattr(defaults, k) if v is None else v for k, v in given.items()})


class ReferencePipeline:
    """Loaded once; `generate` runs one request."""

    def __init__(self, checkpoint: Checkpoint, preprocessor: RequestPreprocessor,
                 vision: VisionStep, decoder, stop_token_ids: tuple[int, ...]) -> None:
        self.checkpoint = checkpoint
        self.preprocessor = preprocessor
        self.vision = vision
        self.decoder = decoder
        self.stop_token_ids = stop_token_ids
        # The served postprocessing's detokenizer, so both stream the same text.
        self.token_bytes = TokenBytes.from_tokenizer_json(checkpoint.path / "tokenizer.json")

    @classmethod
    def load(cls, model: str | Path, *, checkpoint: str | Path | None = None,
             device: str = "cpu", dtype: Dtype | str | None = None,
             max_seq_len: int = 8192,
             limits: RequestLimits | None = None) -> ReferencePipeline:
        """`checkpoint`: a folder written by `qvl-trt convert` from `model`; without it the
        model is converted into a temporary folder (in its own dtype: lossless) with
        max_position_embeddings = `max_seq_len`. `dtype` is the compute precision: float32
        on a CPU by default, the checkpoint's on CUDA. `limits`: what a request may hold (a
        deployment's; default: what the decoder holds); max_seq_len is the decoder's."""
        require("torch", extra="export", why="run the reference pipeline")
        from .reference import ReferenceDecoder

        ckpt = open_checkpoint(model)
        compute = (pick(dtype, DTYPES, "dtype") if dtype is not None
                   else Dtype.FLOAT32 if device == "cpu" else None)
        if checkpoint is None:
            decoder = _decoder_of_temporary_conversion(ckpt, max_seq_len, device, compute)
        else:
            _check_converted_from(read_llm_config(Path(checkpoint)), ckpt, Path(checkpoint))
            decoder = ReferenceDecoder.load(checkpoint, device=device, dtype=compute)
        positions = decoder.config.max_position_embeddings
        limits = dataclasses.replace(limits, max_seq_len=positions) if limits else \
            dataclasses.replace(RequestLimits.of_checkpoint(ckpt), max_seq_len=positions,
                                max_input_len=positions - 1)
        preprocessor = RequestPreprocessor.from_checkpoint(ckpt.path, limits)
        tower = reference_tower(ckpt, device=str(decoder.device),
                                dtype=str(decoder.dtype).removeprefix("torch."))
        # The served vision step. Its cache keeps nothing here (capacity 0): the decoder
        # takes the table as a tensor, and a cached one is read-only.
        vision = VisionStep(tower, ckpt.vision, hidden_size=ckpt.text.hidden_size,
                            table_dtype=np.float32, cache=RowCache(0))
        return cls(ckpt, preprocessor, vision, decoder, ckpt.generation.end_ids)

    def prepare(self, messages: Sequence[Mapping[str, Any]],
                images: Sequence[ImageInput] = (), *,
                sampling: SamplingParams | None = None,
                videos: Sequence[VideoInput] = ()) -> tuple[PreparedRequest, DecodeRequest]:
        """The engine inputs of one request: preprocessing, then the vision tower."""
        prepared = self.preprocessor.prepare(messages=messages, images=images, videos=videos)
        sampling = sampling or SamplingParams()
        if not sampling.stop_token_ids:
            sampling = dataclasses.replace(sampling, stop_token_ids=self.stop_token_ids)
        # A text-only request has no table (the served step sends zero rows instead).
        table = self.vision(prepared.pixel_values, prepared.image_grid_thw,
                            prepared.image_hashes)[0] if prepared.images else None
        request = DecodeRequest(
            input_ids=prepared.engine_input_ids, prompt_table=table,
            mrope_rotary_cos_sin=prepared.mrope_rotary_cos_sin,
            mrope_position_delta=prepared.mrope_position_delta, sampling=sampling)
        return prepared, request

    def generate(self, messages: Sequence[Mapping[str, Any]],
                 images: Sequence[ImageInput] = (), *,
                 sampling: SamplingParams | None = None,
                 on_text: Callable[[TextDelta], None] | None = None,
                 videos: Sequence[VideoInput] = ()) -> GenerationOutput:
        """Run one request; `on_text` sees each token with the text it adds."""
        prepared, request = self.prepare(messages, images, sampling=sampling, videos=videos)
        stream = StreamDecoder(self.token_bytes)
        pieces: list[str] = []

        def on_token(event) -> None:
            delta = TextDelta(event.token_id, stream.push(
                [event.token_id], final=event.finish_reason is not None))
            pieces.append(delta.text)
            if on_text is not None:
                on_text(delta)

        result = self.decoder.generate([request], on_token=on_token)[0]
        return GenerationOutput(
            text="".join(pieces), token_ids=result.token_ids,
            finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
            image_tokens=sum(prepared.image_token_counts))

    def ask(self, prompt: str, images: Sequence[ImageInput] = (), *,
            sampling: SamplingParams | None = None,
            on_text: Callable[[TextDelta], None] | None = None,
            videos: Sequence[VideoInput] = ()) -> GenerationOutput:
        """One user turn: the images, the videos, then the text."""
        return self.generate(user_message(prompt, len(images), len(videos)), images,
                             sampling=sampling, on_text=on_text, videos=videos)


def _decoder_of_temporary_conversion(ckpt: Checkpoint, max_seq_len: int, device: str,
                                     compute: Dtype | None):
    from .convert import convert_checkpoint
    from .reference import ReferenceDecoder

    source = ckpt.source_dtype if ckpt.source_dtype in DTYPES else Dtype.FLOAT32
    with tempfile.TemporaryDirectory(prefix="qvl-trt-reference-") as tmp:
        out = convert_checkpoint(ckpt, Path(tmp) / "llm", dtype=source,
                                 max_seq_len=min(max_seq_len, ckpt.text.max_position_embeddings))
        return ReferenceDecoder.load(out.out, device=device, dtype=compute)


def _check_converted_from(config: LlmConfig, ckpt: Checkpoint, path: Path) -> None:
    text = ckpt.text
    mine = (config.vocab_size, config.hidden_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_size,
            config.num_deepstack_layers)
    theirs = (text.vocab_size, text.hidden_size, text.num_layers, text.num_heads,
              text.num_kv_heads, text.head_dim, ckpt.vision.deepstack_count)
    if mine != theirs:
        raise CheckpointError(f"{path} was not converted from {ckpt.path} (its dimensions "
                              "differ); convert this model with `qvl-trt convert`")
