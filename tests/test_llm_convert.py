"""HF -> TensorRT-LLM checkpoint conversion: config keys, weight layout per TP rank, dtypes,
released sizes, and bad input (one-line errors, nothing half-written)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.cli import app
from qvl_trt.errors import CheckpointError, ConfigError
from qvl_trt.llm import convert as convert_module
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.layout import (
    ARCHITECTURE,
    llm_config,
    merge,
    rank_shape,
    read_llm_config,
    shard,
    weight_sources,
)
from qvl_trt.testing.tiny_checkpoint import TinyDims, write_config_only, write_tiny_checkpoint

# config.json of the converted checkpoint, in order (the keys TensorRT-LLM's
# tensorrt_llm/models/modeling_utils.py PretrainedConfig reads + what the engine needs).
CONFIG_KEYS = [
    "architecture", "dtype", "logits_dtype", "vocab_size", "max_position_embeddings",
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_size", "intermediate_size", "hidden_act", "norm_epsilon", "position_embedding_type",
    "rotary_base", "rotary_scaling", "rotary_embedding_dim", "qwen_type", "qk_layernorm",
    "attn_bias", "mlp_bias", "tie_word_embeddings", "use_parallel_embedding",
    "embedding_sharding_dim", "num_deepstack_layers", "mapping", "quantization",
]
LM = "model.language_model."


@pytest.fixture(scope="module")
def tp1(tiny_ckpt: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("convert") / "tp1"
    convert_checkpoint(tiny_ckpt, out, max_seq_len=4096, dtype="float32")
    return out


@pytest.fixture(scope="module")
def hf(tiny_ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def untied4(tmp_path_factory) -> Path:
    """Untied embeddings and 4 KV heads, so TP 4 divides them."""
    dims = TinyDims(text_heads=4, text_kv_heads=4, head_dim=16, text_layers=2)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("untied") / "ckpt", seed=1, dims=dims,
                                 tie_word_embeddings=False)


def test_config_json(tp1: Path, tiny_ckpt: Path) -> None:
    data = json.loads((tp1 / "config.json").read_text())
    assert list(data) == CONFIG_KEYS
    text = open_checkpoint(tiny_ckpt).text
    assert data["architecture"] == ARCHITECTURE
    assert data["dtype"] == "float32" and data["logits_dtype"] == "float32"
    assert data["position_embedding_type"] == "mrope" and data["qwen_type"] == "qwen3"
    assert data["rotary_base"] == 5_000_000.0  # rope_theta, not TensorRT-LLM's 1e5 default
    assert data["rotary_scaling"] == {"type": "mrope", "mrope_section": list(text.mrope_section),
                                      "mrope_interleaved": True}
    assert data["head_size"] == data["rotary_embedding_dim"] == text.head_dim == 32
    assert data["hidden_size"] == 64 and data["num_attention_heads"] * 32 != 64
    assert data["max_position_embeddings"] == 4096  # bounded by max_seq_len, not 262144
    assert data["num_deepstack_layers"] == 3
    assert data["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert data["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert (data["attn_bias"], data["mlp_bias"], data["qk_layernorm"]) == (False, False, True)
    assert read_llm_config(tp1).num_key_value_heads == 2
    assert sorted(p.name for p in tp1.iterdir()) == ["config.json", "rank0.safetensors"]


def test_weights_follow_the_trtllm_layout(tp1: Path, hf: dict[str, torch.Tensor]) -> None:
    got = load_file(str(tp1 / "rank0.safetensors"))
    assert torch.equal(got["transformer.vocab_embedding.weight"], hf[LM + "embed_tokens.weight"])
    assert torch.equal(got["lm_head.weight"], hf[LM + "embed_tokens.weight"])  # tied
    assert torch.equal(got["transformer.ln_f.weight"], hf[LM + "norm.weight"])
    for i in range(4):
        t, s = f"transformer.layers.{i}.", f"{LM}layers.{i}."
        a = s + "self_attn."
        qkv = torch.cat([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                         hf[a + "v_proj.weight"]])
        pairs = {
            "attention.qkv.weight": qkv,
            "attention.dense.weight": hf[a + "o_proj.weight"],
            "attention.q_layernorm.weight": hf[a + "q_norm.weight"],
            "attention.k_layernorm.weight": hf[a + "k_norm.weight"],
            "input_layernorm.weight": hf[s + "input_layernorm.weight"],
            "post_layernorm.weight": hf[s + "post_attention_layernorm.weight"],
            "mlp.fc.weight": hf[s + "mlp.gate_proj.weight"],  # the activated branch
            "mlp.gate.weight": hf[s + "mlp.up_proj.weight"],
            "mlp.proj.weight": hf[s + "mlp.down_proj.weight"],
        }
        for name, expected in pairs.items():
            assert torch.equal(got[t + name], expected), t + name
    assert len(got) == 3 + 9 * 4


def test_tp2_ranks_split_by_head_and_merge_back(tp1: Path, tiny_ckpt: Path, tmp_path) -> None:
    convert_checkpoint(tiny_ckpt, tmp_path / "tp2", max_seq_len=4096, dtype="float32",
                       tp_size=2)
    config = read_llm_config(tmp_path / "tp2")
    assert config.mapping.tp_size == config.mapping.world_size == 2
    ranks = [load_file(str(tmp_path / "tp2" / f"rank{r}.safetensors")) for r in range(2)]
    full = load_file(str(tp1 / "rank0.safetensors"))
    p = "transformer.layers.0."
    # 4 heads, 2 KV heads, head_dim 32: per rank 2 q heads + 1 k head + 1 v head.
    assert ranks[0][p + "attention.qkv.weight"].shape == (4 * 32, 64)
    q, k, v = full[p + "attention.qkv.weight"].split([128, 64, 64])
    assert torch.equal(ranks[1][p + "attention.qkv.weight"],
                       torch.cat([q[64:], k[32:], v[32:]]))
    assert torch.equal(ranks[1][p + "attention.dense.weight"],
                       full[p + "attention.dense.weight"][:, 64:])
    assert torch.equal(ranks[1][p + "mlp.fc.weight"], full[p + "mlp.fc.weight"][64:])
    assert torch.equal(ranks[1][p + "mlp.proj.weight"], full[p + "mlp.proj.weight"][:, 64:])
    assert torch.equal(ranks[1]["lm_head.weight"], full["lm_head.weight"][151936 // 2:])
    assert torch.equal(ranks[1]["transformer.vocab_embedding.weight"],
                       full["transformer.vocab_embedding.weight"])  # not split
    for name in full:
        assert torch.equal(merge(name, [r[name] for r in ranks], config), full[name]), name


def test_tp4_untied_bf16_and_fp16(untied4: Path, tmp_path) -> None:
    hf = load_file(str(untied4 / "model.safetensors"))
    for dtype in ("bfloat16", "float16"):
        out = tmp_path / dtype
        convert_checkpoint(untied4, out, max_seq_len=512, dtype=dtype, tp_size=4)
        config = read_llm_config(out)
        ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(4)]
        assert {t.dtype for r in ranks for t in r.values()} == {getattr(torch, dtype)}
        assert ranks[3]["transformer.layers.1.attention.qkv.weight"].shape == (3 * 16, 64)
        for name, sources in weight_sources(open_checkpoint(untied4).text).items():
            merged = merge(name, [r[name] for r in ranks], config)
            expected = torch.cat([hf[s] for s in sources]).to(getattr(torch, dtype))
            assert torch.equal(merged, expected), name
        lm_head = merge("lm_head.weight", [r["lm_head.weight"] for r in ranks], config)
        assert torch.equal(lm_head, hf["lm_head.weight"].to(getattr(torch, dtype)))
        assert not torch.equal(lm_head.float(), hf[LM + "embed_tokens.weight"])
        assert config.tie_word_embeddings is False


def test_lm_head_vocab_is_padded_to_the_tp_size(tiny_ckpt: Path) -> None:
    text = dataclasses.replace(open_checkpoint(tiny_ckpt).text, vocab_size=10, hidden_size=3)
    config = llm_config(text, 3, dtype="float32", tp_size=4, max_position_embeddings=64)
    weight = torch.arange(30.0).reshape(10, 3)
    pieces = [shard("lm_head.weight", [weight], config, r) for r in range(4)]
    assert [tuple(p.shape) for p in pieces] == [(3, 3)] * 4
    assert torch.equal(pieces[3][1:], torch.zeros(2, 3))
    assert rank_shape("lm_head.weight", [(10, 3)], config) == (3, 3)
    assert torch.equal(merge("lm_head.weight", pieces, config), weight)


@pytest.mark.parametrize("variant, tie, layers", [("2b", True, 28), ("4b", True, 36),
                                                   ("8b", False, 36)])
def test_released_sizes(variant: str, tie: bool, layers: int, tmp_path) -> None:
    ckpt = open_checkpoint(write_config_only(tmp_path / variant, variant))
    config = llm_config(ckpt.text, ckpt.vision.deepstack_count, dtype="float16", tp_size=2,
                        max_position_embeddings=8192)
    assert (config.head_size, config.rotary_embedding_dim, config.num_key_value_heads) == (
        128, 128, 8)
    assert config.rotary_scaling.mrope_section == (24, 20, 20)
    assert config.num_hidden_layers == layers and config.tie_word_embeddings is tie
    sources = weight_sources(ckpt.text)
    assert sources["lm_head.weight"] == (
        (LM + "embed_tokens.weight",) if tie else ("lm_head.weight",))
    qkv = sources["transformer.layers.0.attention.qkv.weight"]
    shape = rank_shape("transformer.layers.0.attention.qkv.weight",
                       [ckpt.expected[s] for s in qkv], config)
    assert shape == ((config.num_attention_heads // 2 + 8) * 128, config.hidden_size)
    with pytest.raises(CheckpointError, match="config only"):
        convert_checkpoint(ckpt, tmp_path / "out", max_seq_len=8192)
    assert not (tmp_path / "out").exists()


# ---- bad input -------------------------------------------------------------------------------


def _modified_copy(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` whose tensors went through `change(dict)`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


def _nothing_written(parent: Path) -> bool:
    return not (parent / "out").exists() and not list(parent.glob(".out.partial-*"))


def test_missing_tensor(tiny_ckpt: Path, tmp_path) -> None:
    name = LM + "layers.2.mlp.up_proj.weight"
    bad = _modified_copy(tiny_ckpt, tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        convert_checkpoint(bad, tmp_path / "out", max_seq_len=64)
    # A checkpoint opened without validation is checked by the converter itself.
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        convert_checkpoint(open_checkpoint(bad, validate=False), tmp_path / "out",
                           max_seq_len=64)
    assert _nothing_written(tmp_path)


def test_wrong_shape(tiny_ckpt: Path, tmp_path) -> None:
    name = LM + "layers.0.self_attn.k_norm.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:16].clone()

    bad = _modified_copy(tiny_ckpt, tmp_path / "bad", shrink)
    with pytest.raises(CheckpointError, match=r"k_norm.weight has shape \[16\] but config"):
        convert_checkpoint(open_checkpoint(bad, validate=False), tmp_path / "out",
                           max_seq_len=64)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("value, message", [
    (1e6, "holds values that are not finite in float16; convert with --dtype bfloat16"),
    (float("nan"), "holds NaN or infinite values in the checkpoint itself; the checkpoint is "
                   "damaged"),
    (float("-inf"), "in the checkpoint itself"),
], ids=["overflow", "nan", "inf"])
def test_values_not_finite_in_fp16(tiny_ckpt: Path, tmp_path, value, message) -> None:
    name = LM + "layers.1.mlp.down_proj.weight"

    def blow_up(tensors):
        tensors[name][3, 5] = value

    bad = _modified_copy(tiny_ckpt, tmp_path / "bad", blow_up)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(bad, tmp_path / "out", max_seq_len=64, dtype="float16")
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp_size": 4}, r"tensor-parallel size 4 does not divide the model's 2 KV heads; use one "
                     r"of \[1, 2\]"),
    ({"tp_size": 3}, "tensor-parallel size 3 does not divide the model's 4 attention heads"),
    ({"tp_size": 0}, "must be a positive integer"),
    ({"dtype": "int8"}, "dtype 'int8' is not one of float16, bfloat16, float32"),
    ({"max_seq_len": 300000}, "must be between 1 and the model's max_position_embeddings"),
])
def test_bad_options(tiny_ckpt: Path, tmp_path, kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        convert_checkpoint(tiny_ckpt, tmp_path / "out", **{"max_seq_len": 64, **kwargs})
    assert _nothing_written(tmp_path)


def test_existing_output_needs_force(tiny_ckpt: Path, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="already exists; pass --force"):
        convert_checkpoint(tiny_ckpt, out, max_seq_len=64)
    assert (out / "old.txt").exists()
    with pytest.raises(ConfigError, match="holds the source checkpoint"):
        convert_checkpoint(tiny_ckpt, tiny_ckpt, max_seq_len=64, force=True)
    convert_checkpoint(tiny_ckpt, out, max_seq_len=64, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupted_conversion_leaves_nothing(tiny_ckpt: Path, tmp_path, monkeypatch) -> None:
    calls = []
    real = convert_module.SafetensorsStream.write

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) == 7:
            raise OSError("disk full")
        real(self, name, tensor)

    monkeypatch.setattr(convert_module.SafetensorsStream, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(tiny_ckpt, tmp_path / "out", max_seq_len=64, tp_size=2)
    assert list(tmp_path.iterdir()) == []


# ---- CLI -----------------------------------------------------------------------------------


def test_cli_convert(tiny_ckpt: Path, tmp_path) -> None:
    runner = CliRunner()
    args = ["convert", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"),
            "--gpu", "4090d", "--dtype", "float16", "--tp-size", "2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rank_files"] == ["rank0.safetensors", "rank1.safetensors"]
    assert summary["config"]["max_position_embeddings"] == 16384  # the 4090d profile's limit
    again = runner.invoke(app, args)
    assert again.exit_code == 1
    assert "already exists; pass --force" in again.output
    assert len(again.output.strip().splitlines()) == 1
    both = runner.invoke(app, args[:5] + ["--gpu", "4090d", "--max-seq-len", "64"])
    assert both.exit_code == 1 and "exactly one of --gpu" in both.output
