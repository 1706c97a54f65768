"""HF Qwen3-VL text weights -> TensorRT-LLM checkpoint (config.json + rank{N}.safetensors).

Streaming: each weight is read from the HF shards (memory-mapped, one tensor at a time), cast,
cut for every rank and appended to the rank files, so peak memory is about the largest weight,
not the model. A weight-only checkpoint differs only in config.json's quant_algo: its linears
stay in the model dtype, and TensorRT-LLM quantizes them at engine build
(qvl_trt.llm.weight_only). The output folder is written under a temporary name and renamed
when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import staged_dir
from ..checkpoint import Checkpoint, TextDims, open_checkpoint
from ..deps import require
from ..dtypes import Dtype, WeightOnly, pick
from ..errors import CheckpointError, ConfigError
from ..manifest import CONFIG_NAME
from ..typed_config import to_jsonable
from .layout import (
    DTYPES,
    LlmConfig,
    check_tp_size,
    llm_config,
    rank_shape,
    shard,
    weight_sources,
)
from .safetensors_stream import SafetensorsStream
from .weight_only import FEATURE_MULTIPLE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    config: LlmConfig
    rank_files: tuple[str, ...]
    total_bytes: int
    seconds: float


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def convert_checkpoint(
    model: str | Path | Checkpoint,
    out: str | Path,
    *,
    max_seq_len: int,
    dtype: Dtype | str = Dtype.FLOAT16,
    tp_size: int = 1,
    weights: WeightOnly | str = WeightOnly.NONE,
    force: bool = False,
) -> ConvertResult:
    """Convert the language model of an HF Qwen3-VL checkpoint into a TensorRT-LLM checkpoint
    at `out` for `tp_size` ranks. `max_seq_len` (the engine's) becomes
    max_position_embeddings, which sizes the per-request MRoPE table. `weights` int8/int4
    makes the decoder's linears weight-only: config.json says W8A16 / W4A16 and the weights
    stay in `dtype` for TensorRT-LLM's loader to quantize at engine build (embedding and
    lm_head stay unquantized). `out` must not exist unless `force`, which replaces it
    once the new checkpoint is complete."""
    started = time.perf_counter()
    require("torch", extra="export", why="convert the checkpoint")
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    out = Path(out)
    config = llm_config_for(ckpt, dtype=dtype, tp_size=tp_size, max_seq_len=max_seq_len,
                            weights=weights)
    _check_out(out, ckpt, force)
    sources = weight_sources(ckpt.text)
    _check_sources(ckpt, sources)
    shapes = {name: rank_shape(name, [ckpt.tensors[s].shape for s in srcs], config)
              for name, srcs in sources.items()}
    log.info("converting %s -> %s (%s, weights %s, TP %d, max_position_embeddings %d)",
             ckpt.path, out, config.dtype, config.weight_only, tp_size,
             config.max_position_embeddings)
    with staged_dir(out) as staging:
        _write_ranks(ckpt, staging, config, sources, shapes)
        (staging / CONFIG_NAME).write_text(json.dumps(to_jsonable(config), indent=2) + "\n")
    files = tuple(rank_file(r) for r in range(tp_size))
    total = sum((out / f).stat().st_size for f in files)
    seconds = time.perf_counter() - started
    return ConvertResult(out, config, files, total, seconds)


def resolve_max_seq_len(gpu: str | None, max_seq_len: int | None) -> int:
    """The engine's max_seq_len: from the GPU profile, or given directly (not both)."""
    if (gpu is None) == (max_seq_len is None):
        raise ConfigError("give exactly one of --gpu (the profile's limits.max_seq_len) and "
                          "--max-seq-len")
    if gpu is not None:
        from ..profiles import load_profile

        return load_profile(gpu).limits.max_seq_len
    return max_seq_len


def llm_config_for(ckpt: Checkpoint, *, dtype: Dtype | str, tp_size: int,
                   max_seq_len: int, weights: WeightOnly | str = WeightOnly.NONE) -> LlmConfig:
    """The TensorRT-LLM config a conversion would write, refusing what it cannot convert
    (TP size, max_seq_len, weight-only feature sizes, no weights); cheap: `qvl-trt build`
    checks it before any stage."""
    text = ckpt.text
    dtype = pick(dtype, DTYPES, "dtype")
    try:
        weights = WeightOnly(weights)
    except ValueError:
        raise ConfigError(f"weights {weights!r} is not one of "
                          f"{', '.join(w.value for w in WeightOnly)}") from None
    check_tp_size(text, tp_size)
    if not 0 < max_seq_len <= text.max_position_embeddings:
        raise ConfigError(f"max_seq_len {max_seq_len} must be between 1 and the model's "
                          f"max_position_embeddings ({text.max_position_embeddings})")
    if weights is not WeightOnly.NONE:
        _check_weight_only_features(text, tp_size, weights)
    if not ckpt.has_weights:
        raise CheckpointError(f"{ckpt.path} holds a config only, no weights; point --model at "
                              "a checkpoint with its safetensors files")
    return llm_config(text, ckpt.vision.deepstack_count, dtype=dtype, tp_size=tp_size,
                      max_position_embeddings=max_seq_len, weights=weights)


def _check_weight_only_features(text: TextDims, tp_size: int, weights: WeightOnly) -> None:
    """TensorRT-LLM's weight-only linears pad feature counts that are not multiples of
    64 x TP size (WeightOnlyQuantLinear), and would then not take the unpadded weights."""
    multiple = FEATURE_MULTIPLE * tp_size
    sizes = {"hidden size": text.hidden_size, "intermediate size": text.intermediate_size,
             "attention width (heads x head_dim)": text.num_heads * text.head_dim,
             "KV width (KV heads x head_dim)": text.num_kv_heads * text.head_dim}
    for what, size in sizes.items():
        if size % multiple:
            raise ConfigError(f"--weights {weights} needs the model's {what} ({size}) to be a "
                              f"multiple of {multiple} (64 x TP size {tp_size}); use a smaller "
                              "--tp-size or --weights none")


def _check_out(out: Path, ckpt: Checkpoint, force: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise ConfigError(f"output folder {out} already exists; pass --force to replace it or "
                          "choose another --out")
    if out.resolve() == ckpt.path.resolve() or ckpt.path.resolve().is_relative_to(
            out.resolve()):
        raise ConfigError(f"output folder {out} holds the source checkpoint; choose another "
                          "--out")
    if not out.is_dir():
        raise ConfigError(f"output path {out} exists and is not a folder; remove it or choose "
                          "another --out")


def _check_sources(ckpt: Checkpoint, sources: dict[str, tuple[str, ...]]) -> None:
    """Every tensor the conversion reads exists with the shape config.json implies (the
    checkpoint may have been opened without validation)."""
    for names in sources.values():
        for name in names:
            info = ckpt.tensor_info(name)
            expected = ckpt.expected[name]
            if info.shape != expected:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {name} has shape {list(info.shape)} but config.json "
                    f"implies {list(expected)}; the config does not belong to these weights")


def _write_ranks(ckpt: Checkpoint, folder: Path, config: LlmConfig,
                 sources: dict[str, tuple[str, ...]],
                 shapes: dict[str, tuple[int, ...]]) -> None:
    with contextlib.ExitStack() as stack:
        streams = [stack.enter_context(SafetensorsStream(folder / rank_file(r), config.dtype,
                                                         shapes))
                   for r in range(config.tp_size)]
        for name, names in sources.items():
            tensors = [_cast(ckpt.load(s), config.dtype, s) for s in names]
            for rank, stream in enumerate(streams):
                stream.write(name, shard(name, tensors, config, rank))
            log.debug("wrote %s", name)
            del tensors


def _cast(tensor, dtype: Dtype, name: str):
    torch = require("torch", extra="export", why="convert the checkpoint")
    cast = tensor.to(dtype.torch())
    # A NaN or an infinity reaches aminmax's result: one pass, no mask of the tensor's size
    # (isfinite(...).all() takes about 25 times as long).
    if cast.numel() and not all(bool(torch.isfinite(end)) for end in torch.aminmax(cast)):
        raise CheckpointError(_not_finite(torch, tensor, dtype, name))
    return cast


def _not_finite(torch, tensor, dtype: Dtype, name: str) -> str:
    """Why `tensor` is not finite in `dtype`: already in the checkpoint (a broken file: no
    dtype helps), or out of `dtype`'s range (a wider one holds it)."""
    if not all(bool(torch.isfinite(end)) for end in torch.aminmax(tensor)):
        return (f"tensor {name} holds NaN or infinite values in the checkpoint itself; the "
                "checkpoint is damaged: download or export it again")
    hint = "; convert with --dtype bfloat16" if dtype is Dtype.FLOAT16 else ""
    return f"tensor {name} holds values that are not finite in {dtype}{hint}"
