"""The checkpoint reader: variants, lazy tensors, and every refusal with its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import CheckpointError
from qvl_trt.testing.tiny_checkpoint import write_config_only, write_tiny_checkpoint


@pytest.fixture
def ckpt_copy(tiny_ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_tiny_checkpoint_opens_and_reads_lazily(tiny_ckpt):
    ckpt = open_checkpoint(tiny_ckpt)
    assert ckpt.variant == "custom" and ckpt.has_weights
    assert set(ckpt.expected) <= set(ckpt.tensors)
    emb = ckpt.load("model.language_model.embed_tokens.weight")
    assert tuple(emb.shape) == (ckpt.text.vocab_size, ckpt.text.hidden_size)
    assert ckpt.text.mrope_interleaved and sum(ckpt.text.mrope_section) == ckpt.text.head_dim // 2
    assert ckpt.vision.deepstack_count == 3
    summary = ckpt.summary()
    assert summary["parameters"]["llm"] > 0 and "tokenizer.json" in summary["tokenizer_files"]


@pytest.mark.parametrize("variant", ["2b", "4b", "8b"])
def test_released_configs_are_recognised(tmp_path, variant):
    ckpt = open_checkpoint(write_config_only(tmp_path / variant, variant))
    assert ckpt.variant == variant and not ckpt.has_weights
    assert ckpt.text.mrope_section == (24, 20, 20) and ckpt.text.rope_theta == 5e6
    with pytest.raises(CheckpointError, match="holds a config only"):
        ckpt.load("model.language_model.norm.weight")


def test_sharded_checkpoint_reads_through_the_index(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", shards=3)
    ckpt = open_checkpoint(path)
    assert len({i.file for i in ckpt.tensors.values()}) == 3
    assert ckpt.load("model.visual.pos_embed.weight").shape[0] == 2304


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nowhere")


def test_file_instead_of_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        open_checkpoint(tmp_path / "f")


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_checkpoint(ckpt_copy)


def test_corrupt_config(ckpt_copy):
    (ckpt_copy / "config.json").write_text('{"model_type": "qwen3_vl", ')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        open_checkpoint(ckpt_copy)


def test_config_missing_a_field(ckpt_copy):
    _edit_config(ckpt_copy, lambda c: c["text_config"].pop("hidden_size"))
    with pytest.raises(CheckpointError, match="lacks or mangles a field.*hidden_size"):
        open_checkpoint(ckpt_copy)


def test_moe_is_refused(ckpt_copy):
    _edit_config(ckpt_copy, lambda c: c.update(model_type="qwen3_vl_moe"))
    with pytest.raises(CheckpointError, match="MoE checkpoint.*only dense"):
        open_checkpoint(ckpt_copy)


def test_other_model_is_refused(ckpt_copy):
    _edit_config(ckpt_copy, lambda c: c.update(model_type="qwen2_5_vl"))
    with pytest.raises(CheckpointError, match="not a Qwen3-VL checkpoint.*'qwen2_5_vl'"):
        open_checkpoint(ckpt_copy)


def test_missing_shard(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", shards=2)
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} .* is missing"):
        open_checkpoint(path)


def test_truncated_shard(ckpt_copy):
    shard = next(ckpt_copy.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a valid safetensors file.*truncated"):
        open_checkpoint(ckpt_copy)


def test_shape_disagreeing_with_config(ckpt_copy):
    _edit_config(ckpt_copy, lambda c: c["text_config"].update(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \[128, 64\] but "
                                              r"config.json implies \[96, 64\]"):
        open_checkpoint(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    # An untied config needs lm_head.weight, which a tied checkpoint does not hold.
    _edit_config(ckpt_copy, lambda c: (c.update(tie_word_embeddings=False),
                                       c["text_config"].update(tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match="tensor lm_head.weight is missing"):
        open_checkpoint(ckpt_copy)
