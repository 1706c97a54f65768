"""generation_config.json, read once (qvl_trt.generation_config via Checkpoint.generation):
transformers' semantics for do_sample and for what the file leaves out, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import CheckpointError
from qvl_trt.generation_config import GenerationConfig, SamplingDefaults

QWEN = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
        "eos_token_id": [151645, 151643], "pad_token_id": 151643}
MODEL = {"text_config": {"eos_token_id": 151645}}


def test_sampling_only_when_do_sample_is_true() -> None:
    qwen = GenerationConfig.from_json(QWEN, MODEL).sampling_defaults()
    assert (qwen.temperature, qwen.top_k, qwen.top_p) == (0.7, 20, 0.8)
    # transformers: `do_sample is not True` -> greedy search, whatever temperature/top_k say.
    for unset in ({k: v for k, v in QWEN.items() if k != "do_sample"}, {**QWEN, "do_sample": False}):
        assert GenerationConfig.from_json(unset, MODEL).sampling_defaults() == \
            SamplingDefaults(temperature=0.0)
    # What the file leaves out takes transformers' _get_default_generation_params.
    bare = GenerationConfig.from_json({"do_sample": True, "eos_token_id": 7}, MODEL)
    assert bare.sampling_defaults() == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=50)


def test_end_and_pad_ids() -> None:
    qwen = GenerationConfig.from_json(QWEN, MODEL)
    assert (qwen.end_ids, qwen.pad_id) == ((151645, 151643), 151643)
    one = GenerationConfig.from_json({"eos_token_id": 5}, MODEL)
    assert (one.end_ids, one.pad_id) == ((5,), 5)  # no pad id: the first end id
    # No file: transformers' from_model_config, config.json's top level before its text_config.
    assert GenerationConfig.from_json(None, MODEL).end_ids == (151645,)
    top = GenerationConfig.from_json(None, {**MODEL, "eos_token_id": 3, "pad_token_id": 4})
    assert (top.end_ids, top.pad_id, top.sampling_defaults().temperature) == ((3,), 4, 0.0)


@pytest.mark.parametrize(("data", "message"), [
    ({"do_sample": "yes"}, "do_sample = 'yes' must be true or false"),
    ({"top_k": -1}, "top_k = -1 must be an integer >= 0"),
    ({"top_p": 0}, r"top_p = 0 must be in \(0, 1\]"),
    ({"temperature": "hot"}, "temperature = 'hot' must be a number"),
    ({"eos_token_id": []}, "eos_token_id = \\[\\] must be a token id or a list"),
    ({"pad_token_id": 1.5}, "pad_token_id = 1.5 must be a token id"),
])
def test_mistyped_values_are_refused(data, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        GenerationConfig.from_json({"eos_token_id": 1, **data}, MODEL)


def test_no_end_id_anywhere_is_refused() -> None:
    with pytest.raises(CheckpointError, match="no eos_token_id; add"):
        GenerationConfig.from_json({"do_sample": True}, {"text_config": {}})


def test_checkpoint_reads_its_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    assert open_checkpoint(tiny_ckpt, validate=False).generation == \
        GenerationConfig.from_json(json.loads((tiny_ckpt / "generation_config.json")
                                              .read_text()), {})
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    (copy / "generation_config.json").unlink()
    missing = open_checkpoint(copy, validate=False).generation
    assert missing.end_ids == (151645,) and not missing.do_sample  # config.json's text_config
    (copy / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json is not valid JSON"):
        _ = open_checkpoint(copy, validate=False).generation
