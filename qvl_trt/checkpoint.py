"""Read a Hugging Face Qwen3-VL checkpoint directory: config, tensor index, variant.

Tensor headers are parsed without torch so `inspect` and `plan` stay light; tensor data is
loaded lazily, one tensor at a time, through safetensors' memory map.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .deps import require
from .dtypes import Dtype
from .errors import CheckpointError
from .generation_config import GenerationConfig
from .typed_config import to_jsonable

DENSE_MODEL_TYPE = "qwen3_vl"
TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
# Qwen3-VL's image geometry (every published size; VisionDims reads a checkpoint's own):
# 16-pixel patches, 2x2 of them merged into one image token. GPU profiles, the resize policy
# and validate size images with it without a checkpoint at hand.
PATCH_SIZE = 16
SPATIAL_MERGE_SIZE = 2
PIXELS_PER_PATCH = PATCH_SIZE * PATCH_SIZE
# Resized image sides are multiples of this; one image token covers its square in pixels.
RESIZE_FACTOR = PATCH_SIZE * SPATIAL_MERGE_SIZE
PIXELS_PER_IMAGE_TOKEN = RESIZE_FACTOR * RESIZE_FACTOR
# Two frames per temporal patch: a video's pixel budget per merged token is twice an image's.
TEMPORAL_PATCH_SIZE = 2
PIXELS_PER_VIDEO_TOKEN = TEMPORAL_PATCH_SIZE * PIXELS_PER_IMAGE_TOKEN
# The checkpoint's files by who reads them (weights are listed by the tensor index).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "chat_template.json", "chat_template.jinja")
# What the request side (Triton's preprocessing) reads: the model and image configs, the
# generation defaults and the tokenizer; REQUIRED ones it cannot do without.
PREPROCESSING_FILES = ("config.json", "preprocessor_config.json",
                       "video_preprocessor_config.json", "generation_config.json",
                       *TOKENIZER_FILES)
PREPROCESSING_REQUIRED_FILES = ("config.json", "preprocessor_config.json", "tokenizer.json",
                                "tokenizer_config.json")
# What a build reads besides the tokenizer and the weights.
_BUILD_CONFIG_FILES = ("config.json", "generation_config.json", "preprocessor_config.json",
                       "model.safetensors.index.json")

# safetensors dtype tag -> bytes per element: the dtypes qvl-trt computes in, and the others a
# checkpoint may hold.
_DTYPE_BYTES = {
    **{d.safetensors: d.itemsize for d in Dtype},
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass(frozen=True)
class TextDims:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """K and V for every layer, fp16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class VisionDims:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def deepstack_count(self) -> int:
        return len(self.deepstack_visual_indexes)


@dataclass(frozen=True)
class TokenIds:
    image: int
    video: int
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 0)


# The released dense checkpoints, identified by their dimensions.
RELEASED_VARIANTS: dict[str, dict[str, int]] = {
    "2b": dict(hidden=2048, layers=28, heads=16, kv=8, inter=6144, vdepth=24, vhidden=1024),
    "4b": dict(hidden=2560, layers=36, heads=32, kv=8, inter=9728, vdepth=24, vhidden=1024),
    "8b": dict(hidden=4096, layers=36, heads=32, kv=8, inter=12288, vdepth=27, vhidden=1152),
}


def expected_shapes(text: TextDims, vision: VisionDims) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense Qwen3-VL checkpoint holds, with its shape, from the config."""
    t, v = text, vision
    shapes: dict[str, tuple[int, ...]] = {}
    lm = TEXT_PREFIX
    shapes[lm + "embed_tokens.weight"] = (t.vocab_size, t.hidden_size)
    for i in range(t.num_layers):
        p = f"{lm}layers.{i}."
        q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
        shapes[p + "self_attn.q_proj.weight"] = (q, t.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv, t.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv, t.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (t.hidden_size, q)
        shapes[p + "self_attn.q_norm.weight"] = (t.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (t.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (t.intermediate_size, t.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (t.intermediate_size, t.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (t.hidden_size, t.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (t.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (t.hidden_size,)
    shapes[lm + "norm.weight"] = (t.hidden_size,)
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = (t.vocab_size, t.hidden_size)

    vp, h, m = VISION_PREFIX, v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    shapes[vp + "patch_embed.proj.weight"] = (
        h,
        v.in_channels,
        v.temporal_patch_size,
        v.patch_size,
        v.patch_size,
    )
    shapes[vp + "patch_embed.proj.bias"] = (h,)
    shapes[vp + "pos_embed.weight"] = (v.num_position_embeddings, h)
    for i in range(v.depth):
        p = f"{vp}blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (h,)
        shapes[p + "attn.qkv.weight"], shapes[p + "attn.qkv.bias"] = (3 * h, h), (3 * h,)
        shapes[p + "attn.proj.weight"], shapes[p + "attn.proj.bias"] = (h, h), (h,)
        shapes[p + "mlp.linear_fc1.weight"] = (v.intermediate_size, h)
        shapes[p + "mlp.linear_fc1.bias"] = (v.intermediate_size,)
        shapes[p + "mlp.linear_fc2.weight"] = (h, v.intermediate_size)
        shapes[p + "mlp.linear_fc2.bias"] = (h,)
    # The main merger normalises before grouping 2x2 patches, DeepStack mergers after.
    mergers = [(vp + "merger.", h)] + [
        (f"{vp}deepstack_merger_list.{k}.", m) for k in range(v.deepstack_count)
    ]
    for p, norm_width in mergers:
        shapes[p + "norm.weight"] = shapes[p + "norm.bias"] = (norm_width,)
        shapes[p + "linear_fc1.weight"], shapes[p + "linear_fc1.bias"] = (m, m), (m,)
        shapes[p + "linear_fc2.weight"] = (v.out_hidden_size, m)
        shapes[p + "linear_fc2.bias"] = (v.out_hidden_size,)
    return shapes


@dataclass
class Checkpoint:
    """An opened Qwen3-VL checkpoint directory."""

    path: Path
    config: dict[str, Any]
    text: TextDims
    vision: VisionDims
    token_ids: TokenIds
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def variant(self) -> str:
        """ "2b", "4b" or "8b" for the released dimensions, else "custom"."""
        t, v = self.text, self.vision
        dims = dict(
            hidden=t.hidden_size,
            layers=t.num_layers,
            heads=t.num_heads,
            kv=t.num_kv_heads,
            inter=t.intermediate_size,
            vdepth=v.depth,
            vhidden=v.hidden_size,
        )
        return next((name for name, ref in RELEASED_VARIANTS.items() if ref == dims), "custom")

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)

    @property
    def source_dtype(self) -> str:
        tc = self.config.get("text_config", {})
        return str(
            tc.get("dtype") or tc.get("torch_dtype") or self.config.get("torch_dtype")
            or Dtype.BFLOAT16.value
        )

    @cached_property
    def expected(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self.text, self.vision)

    def param_counts(self) -> dict[str, int]:
        """Parameters of the language model and the vision tower, from the config."""
        counts = {"llm": 0, "vision": 0}
        for name, shape in self.expected.items():
            counts["vision" if name.startswith(VISION_PREFIX) else "llm"] += math.prod(shape)
        return counts

    def tensor_info(self, name: str) -> TensorInfo:
        if not self.has_weights:
            raise CheckpointError(
                f"{self.path} holds a config only, no weights ({name} "
                "requested); point --model at a checkpoint with safetensors"
            )
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: tensor {name} is missing; the checkpoint is incomplete or not a "
                "dense Qwen3-VL saved by transformers"
            ) from None

    def load(self, name: str):
        """One tensor as a torch tensor (memory-mapped read of just that tensor)."""
        info = self.tensor_info(name)
        safetensors_torch = require("safetensors.torch", extra="export", why="read weights")
        require("torch", extra="export", why="read weights")
        with safetensors_torch.safe_open(self.path / info.file, framework="pt") as f:
            return f.get_tensor(name)

    def file_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in {i.file for i in self.tensors.values()})

    def _present(self, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if (self.path / n).is_file()]

    @property
    def tokenizer_files(self) -> list[str]:
        return self._present(TOKENIZER_FILES)

    @property
    def preprocessing_files(self) -> list[str]:
        """The files of PREPROCESSING_FILES this checkpoint has."""
        return self._present(PREPROCESSING_FILES)

    @property
    def build_files(self) -> list[str]:
        """Every file a build reads: configs, tokenizer, weights."""
        return (self._present(_BUILD_CONFIG_FILES) + self.tokenizer_files
                + sorted({i.file for i in self.tensors.values()}))

    def summary(self) -> dict[str, Any]:
        """What `qvl-trt inspect` reports, as JSON values."""
        counts = self.param_counts()
        return {
            "path": str(self.path),
            "variant": self.variant,
            "source_dtype": self.source_dtype,
            "has_weights": self.has_weights,
            "tensors": len(self.tensors),
            "file_bytes": self.file_bytes(),
            "parameters": counts,
            "deepstack_layers": self.vision.deepstack_count,
            "text": to_jsonable(self.text),
            "vision": to_jsonable(self.vision),
            "token_ids": to_jsonable(self.token_ids),
            "tokenizer_files": self.tokenizer_files,
        }

    @property
    def preprocessor_config(self) -> dict[str, Any]:
        return _read_json(self.path / "preprocessor_config.json", required=False) or {}

    @property
    def video_preprocessor_config(self) -> dict[str, Any]:
        return _read_json(self.path / "video_preprocessor_config.json", required=False) or {}

    @cached_property
    def generation(self) -> GenerationConfig:
        """generation_config.json (transformers' defaults where it is missing)."""
        path = self.path / "generation_config.json"
        return GenerationConfig.from_json(_read_json(path, required=False), self.config,
                                          where=str(path))


def open_checkpoint(path: str | Path, *, validate: bool = True) -> Checkpoint:
    """Open a Qwen3-VL checkpoint directory, refusing anything else with a clear message.

    With `validate`, every tensor the config implies must exist with its shape (a
    config-only directory, without safetensors, is accepted for planning).
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; --model takes the checkpoint folder")
    config = _read_json(root / "config.json", required=True)
    model_type = config.get("model_type")
    if model_type == "qwen3_vl_moe":
        raise CheckpointError(
            f"{root} is a Qwen3-VL MoE checkpoint (model_type qwen3_vl_moe); only dense "
            "Qwen3-VL checkpoints (2B, 4B, 8B, 32B) are supported"
        )
    if model_type != DENSE_MODEL_TYPE:
        raise CheckpointError(
            f"{root} is not a Qwen3-VL checkpoint (model_type {model_type!r}); expected "
            f"{DENSE_MODEL_TYPE!r}, e.g. Qwen/Qwen3-VL-2B-Instruct"
        )
    try:
        text = _text_dims(config)
        vision = _vision_dims(config)
        token_ids = TokenIds(
            image=int(config.get("image_token_id", 151655)),
            video=int(config.get("video_token_id", 151656)),
            vision_start=int(config.get("vision_start_token_id", 151652)),
            vision_end=int(config.get("vision_end_token_id", 151653)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{root}/config.json lacks or mangles a field ({exc!r}); "
            "re-download the checkpoint's config.json"
        ) from None
    ckpt = Checkpoint(root, config, text, vision, token_ids, _read_tensor_index(root))
    if validate and ckpt.has_weights:
        _validate_shapes(ckpt)
    return ckpt


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(
                f"{path} is missing; is {path.parent} a Hugging Face checkpoint folder?"
            )
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; re-download it")
    return data


def _rope(tc: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    # Released configs (transformers 4.57) write rope_theta + rope_scaling; 5.x writes
    # rope_parameters holding both.
    params = dict(tc.get("rope_parameters") or {})
    params.update(tc.get("rope_scaling") or {})
    theta = tc.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise KeyError("text_config.rope_theta")
    return float(theta), params


def _text_dims(config: dict[str, Any]) -> TextDims:
    tc = config["text_config"]
    theta, rope = _rope(tc)
    heads = int(tc["num_attention_heads"])
    head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // heads)
    section = tuple(int(s) for s in rope.get("mrope_section", ()))
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    tie = config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
    return TextDims(
        hidden_size=int(tc["hidden_size"]),
        num_layers=int(tc["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(tc.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        intermediate_size=int(tc["intermediate_size"]),
        vocab_size=int(tc["vocab_size"]),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        max_position_embeddings=int(tc["max_position_embeddings"]),
        tie_word_embeddings=bool(tie),
    )


def _vision_dims(config: dict[str, Any]) -> VisionDims:
    vc = config["vision_config"]
    return VisionDims(
        depth=int(vc["depth"]),
        hidden_size=int(vc["hidden_size"]),
        intermediate_size=int(vc["intermediate_size"]),
        num_heads=int(vc["num_heads"]),
        out_hidden_size=int(vc["out_hidden_size"]),
        patch_size=int(vc.get("patch_size", PATCH_SIZE)),
        temporal_patch_size=int(vc.get("temporal_patch_size", TEMPORAL_PATCH_SIZE)),
        spatial_merge_size=int(vc.get("spatial_merge_size", SPATIAL_MERGE_SIZE)),
        in_channels=int(vc.get("in_channels", 3)),
        num_position_embeddings=int(vc["num_position_embeddings"]),
        deepstack_visual_indexes=tuple(int(i) for i in vc.get("deepstack_visual_indexes", ())),
        hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
    )


def _read_tensor_index(root: Path) -> dict[str, TensorInfo]:
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map; re-download it")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        shard = root / name
        if not shard.is_file():
            raise CheckpointError(
                f"shard {name} listed in {index_path.name} is missing from "
                f"{root}; the download is incomplete"
            )
        for tname, (dtype, shape) in safetensors_header(shard).items():
            tensors[tname] = TensorInfo(tname, dtype, shape, name)
    return tensors


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor dtypes and shapes from a safetensors header (8-byte length + JSON)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
        out = {}
        end = 8 + length
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, stop = meta["data_offsets"]
            if end + stop > size:
                raise ValueError(f"tensor {name} extends past the end of the file")
            out[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({exc}); the file is "
            "truncated or corrupt, re-download it"
        ) from None
    return out


def _validate_shapes(ckpt: Checkpoint) -> None:
    for name, shape in ckpt.expected.items():
        info = ckpt.tensor_info(name)
        if info.shape != shape:
            raise CheckpointError(
                f"{ckpt.path}: tensor {name} has shape {list(info.shape)} but config.json "
                f"implies {list(shape)}; the config does not belong to these weights"
            )
