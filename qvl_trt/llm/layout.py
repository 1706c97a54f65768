"""The converted TensorRT-LLM checkpoint's contract: config.json keys, weight names, and how
each weight is split across tensor-parallel ranks. `convert` writes it; the reference decoder
and the TensorRT-LLM network read it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import TEXT_PREFIX, TextDims, safetensors_header
from ..deps import require
from ..dtypes import Dtype, WeightOnly
from ..errors import CheckpointError, ConfigError
from ..manifest import CONFIG_NAME
from ..mm.prompt_table import rows_per_visual_token
from ..typed_config import load_dataclass, to_jsonable
from .weight_only import SCALE_SUFFIX, is_quantized

# Our own Qwen3-VL causal LM class (TensorRT-LLM 1.2 has none); the C++ runtime ignores it.
ARCHITECTURE = "Qwen3VLForCausalLM"
# What `convert` writes (float32 for tests and the reference decoder).
DTYPES = (Dtype.FLOAT16, Dtype.BFLOAT16, Dtype.FLOAT32)
# safetensors' tag of int8 tensors: the linears of weight-only checkpoints written before
# TensorRT-LLM quantized them at engine build.
INT8_TAG = "I8"


@dataclass(frozen=True)
class MappingConfig:
    world_size: int
    tp_size: int
    pp_size: int = 1


@dataclass(frozen=True)
class QuantizationConfig:
    """TensorRT-LLM's QuantConfig keys (tensorrt_llm/models/modeling_utils.py): quant_algo
    W8A16 / W4A16 for weight-only INT8 / INT4 linears, which the checkpoint stores in the model
    dtype and TensorRT-LLM quantizes at engine build (qvl_trt.llm.weight_only), None for
    none. exclude_modules is left to TensorRT-LLM's default, which keeps lm_head and the
    embedding in the model dtype."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None

    @property
    def weight_only(self) -> WeightOnly:
        return next(w for w in WeightOnly if w.quant_algo == self.quant_algo)


@dataclass(frozen=True)
class RotaryScaling:
    """Qwen2-VL's rope_scaling shape ({"type": "mrope", "mrope_section": ...}) plus the
    interleaving flag Qwen3-VL adds."""

    type: str
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool


@dataclass(frozen=True)
class LlmConfig:
    """config.json of the converted checkpoint: TensorRT-LLM's PretrainedConfig/QWenConfig
    keys plus `num_deepstack_layers` (K: prompt-table rows per visual token = 1 + K)."""

    architecture: str
    dtype: Dtype
    logits_dtype: Dtype
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    intermediate_size: int
    hidden_act: str
    norm_epsilon: float
    position_embedding_type: str
    rotary_base: float
    rotary_scaling: RotaryScaling
    rotary_embedding_dim: int
    qwen_type: str
    qk_layernorm: bool
    attn_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    use_parallel_embedding: bool
    embedding_sharding_dim: int
    num_deepstack_layers: int
    mapping: MappingConfig
    quantization: QuantizationConfig

    @property
    def tp_size(self) -> int:
        return self.mapping.tp_size

    @property
    def vocab_size_padded(self) -> int:
        """lm_head rows: the vocabulary padded to a multiple of the TP size."""
        return -(-self.vocab_size // self.tp_size) * self.tp_size

    @property
    def rows_per_visual_token(self) -> int:
        return rows_per_visual_token(self.num_deepstack_layers)

    @property
    def weight_only(self) -> WeightOnly:
        return self.quantization.weight_only


def llm_config(text: TextDims, deepstack_layers: int, *, dtype: Dtype, tp_size: int,
               max_position_embeddings: int,
               weights: WeightOnly = WeightOnly.NONE) -> LlmConfig:
    """The converted checkpoint's config for these text dimensions."""
    return LlmConfig(
        architecture=ARCHITECTURE, dtype=dtype, logits_dtype=Dtype.FLOAT32,
        vocab_size=text.vocab_size, max_position_embeddings=max_position_embeddings,
        hidden_size=text.hidden_size, num_hidden_layers=text.num_layers,
        num_attention_heads=text.num_heads, num_key_value_heads=text.num_kv_heads,
        head_size=text.head_dim, intermediate_size=text.intermediate_size, hidden_act="silu",
        norm_epsilon=text.rms_norm_eps, position_embedding_type="mrope",
        rotary_base=text.rope_theta,
        rotary_scaling=RotaryScaling("mrope", text.mrope_section, text.mrope_interleaved),
        rotary_embedding_dim=text.head_dim, qwen_type="qwen3", qk_layernorm=True,
        attn_bias=False, mlp_bias=False, tie_word_embeddings=text.tie_word_embeddings,
        use_parallel_embedding=False, embedding_sharding_dim=0,
        num_deepstack_layers=deepstack_layers,
        mapping=MappingConfig(world_size=tp_size, tp_size=tp_size),
        quantization=QuantizationConfig(quant_algo=WeightOnly(weights).quant_algo),
    )


def check_tp_size(text: TextDims, tp_size: int) -> None:
    """Refuse a tensor-parallel size the split below cannot take: each rank gets whole
    attention heads, whole KV heads (no replication, though TensorRT-LLM would replicate KV
    heads when TP exceeds them) and an equal share of the MLP."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")
    for what, count in (("attention heads", text.num_heads), ("KV heads", text.num_kv_heads),
                        ("intermediate size", text.intermediate_size)):
        if count % tp_size:
            fits = [n for n in (1, 2, 4, 8) if text.num_heads % n == 0
                    and text.num_kv_heads % n == 0 and text.intermediate_size % n == 0]
            raise ConfigError(f"tensor-parallel size {tp_size} does not divide the model's "
                              f"{count} {what}; use one of {fits}")


def read_llm_config(path: Path) -> LlmConfig:
    """config.json of a converted checkpoint folder, strictly validated."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; is {path} a folder written by `qvl-trt "
                              "convert`?")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); convert again") from None
    config = load_dataclass(LlmConfig, data, str(file))
    quant = config.quantization
    if quant.kv_cache_quant_algo is not None or quant.quant_algo not in {
            w.quant_algo for w in WeightOnly}:
        raise CheckpointError(
            f"{file} sets quantization {to_jsonable(quant)}; qvl-trt writes quant_algo "
            f"{' or '.join(w.quant_algo for w in WeightOnly if w.quant_algo)} or none, and no "
            "KV-cache quantization; convert again")
    if config.architecture != ARCHITECTURE or config.mapping.pp_size != 1:
        raise CheckpointError(f"{file} is not a Qwen3-VL checkpoint written by `qvl-trt convert` "
                              f"(architecture {config.architecture}, pp_size "
                              f"{config.mapping.pp_size}); convert the HF checkpoint again")
    return config


def rank_files(path: Path, config: LlmConfig) -> list[Path]:
    """The rank files of a converted checkpoint, refused (from their headers) unless every
    tensor is in the model dtype: weight-only linears too, which TensorRT-LLM's loader
    quantizes only when they are not int8 (tensorrt_llm/models/convert_utils.py
    weight_only_quantize_dict) and otherwise takes as laid out for its GEMM already."""
    files = [Path(path) / f"rank{r}.safetensors" for r in range(config.tp_size)]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: config.json declares TP size "
                                  f"{config.tp_size}; convert again")
        for name, (tag, _) in safetensors_header(file).items():
            if name.endswith(SCALE_SUFFIX) or is_quantized(name) and tag == INT8_TAG:
                raise CheckpointError(
                    f"{file} holds {name} ({tag}): the pre-quantized layout of earlier "
                    "qvl-trt versions, which TensorRT-LLM would take as already laid out for "
                    "its GEMM; convert the HF checkpoint again (qvl-trt convert, or qvl-trt "
                    "build --resume, which converts it again)")
            if tag != config.dtype.safetensors:
                raise CheckpointError(f"{file} holds {name} in {tag}, not the config's "
                                      f"{config.dtype}; convert again")
    return files


class Split(enum.Enum):
    """How a weight is cut across tensor-parallel ranks."""

    REPLICATE = "replicate"
    ROWS = "rows"  # output dim: column-parallel linears (fc, gate, lm_head)
    COLS = "cols"  # input dim: row-parallel linears (dense, proj)
    QKV = "qkv"  # q, k and v each cut by heads, then concatenated per rank


def weight_sources(text: TextDims) -> dict[str, tuple[str, ...]]:
    """TensorRT-LLM weight name -> the HF tensors it is made of, in checkpoint order."""
    lm = TEXT_PREFIX
    out: dict[str, tuple[str, ...]] = {"transformer.vocab_embedding.weight":
                                       (lm + "embed_tokens.weight",)}
    for i in range(text.num_layers):
        hf, t = f"{lm}layers.{i}.", f"transformer.layers.{i}."
        attn = hf + "self_attn."
        out[t + "input_layernorm.weight"] = (hf + "input_layernorm.weight",)
        out[t + "attention.qkv.weight"] = tuple(attn + p + "_proj.weight" for p in "qkv")
        out[t + "attention.dense.weight"] = (attn + "o_proj.weight",)
        out[t + "attention.q_layernorm.weight"] = (attn + "q_norm.weight",)
        out[t + "attention.k_layernorm.weight"] = (attn + "k_norm.weight",)
        out[t + "post_layernorm.weight"] = (hf + "post_attention_layernorm.weight",)
        # GatedMLP computes proj(act(fc(x)) * gate(x)): fc is the activated branch.
        out[t + "mlp.fc.weight"] = (hf + "mlp.gate_proj.weight",)
        out[t + "mlp.gate.weight"] = (hf + "mlp.up_proj.weight",)
        out[t + "mlp.proj.weight"] = (hf + "mlp.down_proj.weight",)
    out["transformer.ln_f.weight"] = (lm + "norm.weight",)
    out["lm_head.weight"] = ((lm + "embed_tokens.weight",) if text.tie_word_embeddings
                             else ("lm_head.weight",))
    return out


_SPLITS = {
    "attention.qkv.weight": Split.QKV,
    "attention.dense.weight": Split.COLS,
    "mlp.fc.weight": Split.ROWS,
    "mlp.gate.weight": Split.ROWS,
    "mlp.proj.weight": Split.COLS,
    "lm_head.weight": Split.ROWS,
}


def split_of(name: str) -> Split:
    return next((s for suffix, s in _SPLITS.items() if name.endswith(suffix)), Split.REPLICATE)


def qkv_rows(config: LlmConfig) -> tuple[int, int, int]:
    """Rows of q, k and v in one rank's fused qkv weight."""
    tp, hd = config.tp_size, config.head_size
    kv = config.num_key_value_heads // tp * hd
    return config.num_attention_heads // tp * hd, kv, kv


def rank_shape(name: str, full: list[tuple[int, ...]], config: LlmConfig) -> tuple[int, ...]:
    """Shape of weight `name` in one rank file, from the shapes of its HF sources."""
    tp = config.tp_size
    split = split_of(name)
    rows, cols = full[0][0], full[0][1:]
    if split is Split.QKV:
        return (sum(qkv_rows(config)), *cols)
    if name == "lm_head.weight":
        return (config.vocab_size_padded // tp, *cols)
    if split is Split.ROWS:
        return (rows // tp, *cols)
    if split is Split.COLS:
        return (rows, cols[0] // tp)
    return full[0]


def shard(name: str, sources: list, config: LlmConfig, rank: int):
    """Rank `rank`'s piece of weight `name` built from its HF source tensors (torch)."""
    torch = _torch()
    tp = config.tp_size
    split = split_of(name)
    if split is Split.QKV:
        return torch.cat([t.chunk(tp, dim=0)[rank] for t in sources], dim=0)
    full = sources[0]
    if name == "lm_head.weight" and config.vocab_size_padded != full.shape[0]:
        pad = full.new_zeros(config.vocab_size_padded - full.shape[0], full.shape[1])
        full = torch.cat([full, pad], dim=0)
    if split is Split.ROWS:
        return full.chunk(tp, dim=0)[rank]
    if split is Split.COLS:
        return full.chunk(tp, dim=1)[rank].contiguous()
    return full


def merge(name: str, pieces: list, config: LlmConfig):
    """The unsplit weight `name` from its per-rank pieces (inverse of `shard`); the fused qkv
    comes back as one [q; k; v] tensor, lm_head without its vocabulary padding."""
    torch = _torch()
    split = split_of(name)
    if split is Split.QKV:
        parts = [p.split(list(qkv_rows(config)), dim=0) for p in pieces]
        return torch.cat([torch.cat([p[i] for p in parts], dim=0) for i in range(3)], dim=0)
    if split is Split.ROWS:
        full = torch.cat(pieces, dim=0)
        return full[: config.vocab_size] if name == "lm_head.weight" else full
    if split is Split.COLS:
        return torch.cat(pieces, dim=1)
    return pieces[0]


def _torch():
    return require("torch", extra="export", why="split and merge checkpoint weights")
