"""Tiny random Qwen3-VL checkpoints with the released layout, and the released configs.

`write_tiny_checkpoint` writes what a user downloads from Qwen/Qwen3-VL-*-Instruct (config
files in the 4.57 layout, safetensors with the released tensor names, the real tokenizer and
chat template) at toy sizes and with seeded random weights, so every stage can be tested on a
CPU without a hub. `write_config_only` writes the released 2B/4B/8B configs without weights,
for code that only reads configs (the planner).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..atomic import staged_dir, write_json_atomic
from ..deps import require
from ..dtypes import Dtype, pick
from ..errors import ConfigError
from .tokenizer_files import CHAT_TEMPLATE, write_tokenizer_files

VOCAB_SIZE = 151_936  # the released embedding rows (151,669 tokens padded), so real ids are valid

# Numbers of the released dense checkpoints (the config.json files of Qwen/Qwen3-VL-{2B,4B,8B}-
# Instruct).
RELEASED: dict[str, dict] = {
    "2b": {
        "text": {
            "hidden_size": 2048,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 6144,
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        "tie_word_embeddings": True,
    },
    "4b": {
        "text": {
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 9728,
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        "tie_word_embeddings": True,
    },
    "8b": {
        "text": {
            "hidden_size": 4096,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 12288,
        },
        "vision": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        "tie_word_embeddings": False,
    },
}

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.0,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "transformers_version": "4.56.0",
}

# min/max are pixel counts (256x256 .. 4096x4096), not edge lengths.
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


_TUPLE_FIELDS = frozenset({"mrope_section", "deepstack_visual_indexes"})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(name: str, value: object, why: str) -> None:
    raise ConfigError(f"TinyDims.{name} = {value!r} {why}")


@dataclass(frozen=True)
class TinyDims:
    """Sizes of a tiny checkpoint. heads * head_dim != hidden on purpose, as in the 4B."""

    text_hidden: int = 64
    text_layers: int = 4  # more than the 3 DeepStack outputs: injecting into every layer shows
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 32
    text_intermediate: int = 128
    # T/H/W frequency slots; None derives them in the release's 24:20:20 proportion.
    mrope_section: tuple[int, int, int] | None = None
    vision_depth: int = 6
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    # Not 0..K-1 and not the last block, like the release's [5, 11, 17] of 24.
    deepstack_visual_indexes: tuple[int, ...] = (1, 3, 4)
    num_position_embeddings: int = 2304  # the released 48x48 table

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _TUPLE_FIELDS:
                if value is not None and not all(_is_int(v) and v >= 0 for v in value):
                    _bad(field.name, value, "must hold non-negative integers")
            elif not (_is_int(value) and value > 0):
                _bad(field.name, value, "must be a positive integer")
        if self.mrope_section is None:
            half = self.head_dim // 2
            height = half * 20 // 64
            object.__setattr__(self, "mrope_section", (half - 2 * height, height, height))
        for name, ok, why in self._checks():
            if not ok:
                _bad(name, getattr(self, name), why)

    def _checks(self) -> list[tuple[str, bool, str]]:
        half = self.head_dim // 2
        mrope = self.mrope_section
        deepstack = self.deepstack_visual_indexes
        side = math.isqrt(self.num_position_embeddings)
        return [
            ("head_dim", self.head_dim % 2 == 0, "must be even"),
            ("text_kv_heads", self.text_heads % self.text_kv_heads == 0, "must divide text_heads"),
            ("mrope_section", len(mrope) == 3 and sum(mrope) == half,
             f"must be 3 numbers summing to head_dim/2 = {half}"),
            ("mrope_section", len(mrope) == 3 and 3 * max(mrope[1:]) <= half,
             "leaves no room to interleave H and W (needs 3 * max(H, W) <= head_dim/2)"),
            ("vision_hidden", self.vision_hidden % (4 * self.vision_heads) == 0,
             "/ vision_heads must be a multiple of 4 (2D rotary over rows and columns)"),
            ("deepstack_visual_indexes", len(set(deepstack)) == len(deepstack)
             and all(i < self.vision_depth for i in deepstack),
             f"must be distinct vision block indexes below vision_depth = {self.vision_depth}"),
            ("num_position_embeddings", side * side == self.num_position_embeddings,
             "must be a square (the table is 2D)"),
        ]  # fmt: skip


def parse_dims(spec: str) -> TinyDims:
    """TinyDims from `key=value,...`; tuple values are written `a:b:c` (`mrope_section=4:2:2`)."""
    names = {field.name: field for field in dataclasses.fields(TinyDims)}
    overrides: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise ConfigError(f"--dims: unknown item {item!r}; known keys: {', '.join(names)}")
        try:
            numbers = tuple(int(v) for v in raw.split(":"))
        except ValueError:
            raise ConfigError(f"--dims: {key} needs integers, got {raw!r}") from None
        overrides[key] = numbers if key in _TUPLE_FIELDS else _single(key, numbers)
    return TinyDims(**overrides)


def tiny_config(
    dims: TinyDims = TinyDims(), *, tie_word_embeddings: bool = True,
    dtype: Dtype = Dtype.FLOAT32,
) -> dict:
    """config.json of a tiny checkpoint, in the released layout."""
    text = {
        "hidden_size": dims.text_hidden,
        "num_hidden_layers": dims.text_layers,
        "num_attention_heads": dims.text_heads,
        "num_key_value_heads": dims.text_kv_heads,
        "head_dim": dims.head_dim,
        "intermediate_size": dims.text_intermediate,
    }
    vision = {
        "depth": dims.vision_depth,
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.vision_intermediate,
        "num_heads": dims.vision_heads,
        "deepstack_visual_indexes": list(dims.deepstack_visual_indexes),
        "num_position_embeddings": dims.num_position_embeddings,
    }
    return _release_layout(text, vision, tie_word_embeddings, dtype, list(dims.mrope_section))


def released_config(variant: str) -> dict:
    """config.json of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct."""
    if variant not in RELEASED:
        raise ConfigError(f"unknown variant {variant!r}; choose one of {', '.join(RELEASED)}")
    numbers = RELEASED[variant]
    return _release_layout(
        numbers["text"], numbers["vision"], numbers["tie_word_embeddings"], Dtype.BFLOAT16,
        [24, 20, 20],
    )


def write_tiny_checkpoint(
    out: Path,
    *,
    seed: int = 0,
    dims: TinyDims = TinyDims(),
    tie_word_embeddings: bool = True,
    dtype: Dtype | str = Dtype.FLOAT32,
    shards: int = 1,
) -> Path:
    """Write a tiny random Qwen3-VL checkpoint directory at `out` and return it.

    `shards > 1` writes model-0000i-of-0000N.safetensors plus model.safetensors.index.json.
    """
    dtype = pick(dtype, tuple(Dtype), "dtype")
    if shards < 1:
        raise ConfigError(f"shards must be >= 1, got {shards}")
    config = tiny_config(dims, tie_word_embeddings=tie_word_embeddings, dtype=dtype)

    def fill(directory: Path) -> None:
        tensors = _random_weights(config, seed, dtype)
        if shards > len(tensors):
            raise ConfigError(f"shards must be <= {len(tensors)} (the tensor count), got {shards}")
        _write_metadata(directory, config)
        write_json_atomic(directory / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
        write_tokenizer_files(directory)
        _write_safetensors(directory, tensors, shards)

    return _write_atomically(Path(out), fill)


def write_config_only(out: Path, variant: str) -> Path:
    """Write the released config.json, generation_config.json, preprocessor_config.json and
    video_preprocessor_config.json of Qwen3-VL-{2B,4B,8B}-Instruct (`variant` "2b", "4b" or
    "8b") at `out`, without weights."""
    config = released_config(variant)
    return _write_atomically(Path(out), lambda directory: _write_metadata(directory, config))


def _release_layout(
    text: dict, vision: dict, tie: bool, dtype: Dtype, mrope_section: list[int]
) -> dict:
    """The config.json layout of the released checkpoints (transformers 4.57.0.dev0): 4.57 keys
    (`rope_scaling` + `rope_theta`, vision model_type "qwen3_vl"), not 5.x `rope_parameters`."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "dtype": dtype.value,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": mrope_section,
                "rope_type": "default",
            },
            "rope_theta": 5000000,
            "tie_word_embeddings": tie,
            "use_cache": True,
            "vocab_size": VOCAB_SIZE,
            **text,
        },
        "tie_word_embeddings": tie,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 151656,
        "vision_config": {
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "initializer_range": 0.02,
            "model_type": "qwen3_vl",
            "num_position_embeddings": 2304,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            **vision,
        },
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    }


def _random_weights(config: dict, seed: int, dtype: Dtype) -> dict:
    """Seeded random tensors under the names and shapes transformers gives this config.

    Each tensor is drawn from its own generator seeded by (seed, name), so the values do not
    depend on the transformers version's init order. Norm weights are near 1 and biases small
    but nonzero: zero biases and unit norms would hide a converter that drops them.
    """
    torch = require("torch", extra="export", why="create the tiny checkpoint's weights")
    shapes = _parameter_shapes(config)
    tensors = {}
    for name in sorted(shapes):
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        noise = torch.randn(shapes[name], generator=generator, dtype=torch.float32)
        if name.endswith(".bias"):
            value = 0.02 * noise
        elif len(shapes[name]) == 1:
            value = 1.0 + 0.1 * noise
        else:
            value = 0.02 * noise
        tensors[name] = value.to(dtype.torch()).contiguous()
    return tensors


def _parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names -> shapes, from the transformers model built on the meta device.
    A tied lm_head is left out, as save_pretrained leaves it out of the released 2B/4B."""
    torch = require("torch", extra="export", why="create the tiny checkpoint's weights")
    transformers = require("transformers", extra="export", why="create the tiny checkpoint")
    # deepcopy: Qwen3VLConfig rewrites the nested dicts it is given.
    hf_config = transformers.Qwen3VLConfig(**copy.deepcopy(config))
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(hf_config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del shapes["lm_head.weight"]
    return shapes


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _write_safetensors(directory: Path, tensors: dict, shards: int) -> None:
    safetensors_torch = require("safetensors.torch", extra="export", why="write safetensors")
    names = sorted(tensors)
    if shards == 1:
        safetensors_torch.save_file(tensors, directory / "model.safetensors", {"format": "pt"})
        return
    weight_map = {}
    for index in range(shards):
        chunk = names[index * len(names) // shards : (index + 1) * len(names) // shards]
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in chunk}
        safetensors_torch.save_file(part, directory / filename, {"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
    metadata = {
        "total_parameters": sum(t.numel() for t in tensors.values()),
        "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
    }
    write_json_atomic(
        directory / "model.safetensors.index.json",
        {"metadata": metadata, "weight_map": weight_map},
    )


def _write_metadata(directory: Path, config: dict) -> None:
    write_json_atomic(directory / "config.json", config)
    write_json_atomic(directory / "generation_config.json", GENERATION_CONFIG)
    write_json_atomic(directory / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json_atomic(directory / "video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)


def _write_atomically(out: Path, fill: Callable[[Path], None]) -> Path:
    """Let `fill` write into a temporary sibling of `out`, then rename it to `out`, so an
    interrupted run leaves no half-written checkpoint behind."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory")
    with staged_dir(out) as staging:
        fill(staging)
    return out


def _single(key: str, numbers: tuple[int, ...]) -> int:
    if len(numbers) != 1:
        raise ConfigError(f"--dims: {key} takes one integer, got {':'.join(map(str, numbers))}")
    return numbers[0]
