"""Planner figures against values computed independently from the released configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.cli import app
from qvl_trt.plan import make_plan
from qvl_trt.profiles import load_profile
from qvl_trt.tiny_checkpoint import write_config_only


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return {v: write_config_only(root / v, v) for v in ("2b", "4b", "8b")}


def _hf_parameter_counts(config_dir):
    """Parameters of the HF model built on the meta device: (vision, language incl. lm_head)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    # remove_duplicate=False counts a tied lm_head once more, as the engine stores it.
    llm = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
              if not n.startswith("model.visual."))
    return vision, llm, config.text_config


@pytest.mark.parametrize("variant", ["2b", "4b", "8b"])
def test_weights_and_kv_match_an_independent_count(released, variant):
    vision, llm, tc = _hf_parameter_counts(released[variant])
    plan = make_plan(open_checkpoint(released[variant]), load_profile("h200"))
    assert plan.vision_weight_bytes == pytest.approx(vision * 2, rel=0.01)
    assert plan.llm_weight_bytes == pytest.approx(llm * 2, rel=0.01)
    assert plan.kv_bytes_per_token == 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 2


def test_published_parameter_totals(released):
    # QWEN3VL.md: 2.128 B / 4.438 B / 8.767 B parameters.
    for variant, total in (("2b", 2.128e9), ("4b", 4.438e9), ("8b", 8.767e9)):
        counts = open_checkpoint(released[variant]).param_counts()
        assert counts["vision"] + counts["llm"] == pytest.approx(total, rel=0.001)


def test_capacity_figures_are_consistent(released):
    profile = load_profile("4090d")
    plan = make_plan(open_checkpoint(released["2b"]), profile)
    assert plan.fits
    lim = profile.limits
    assert plan.prompt_table_rows == lim.max_batch_size * 4 * lim.max_visual_tokens
    assert plan.prompt_table_bytes == plan.prompt_table_rows * 2048 * 2
    assert plan.mrope_table_bytes_per_request == lim.max_seq_len * 128 * 4
    assert plan.kv_capacity_tokens * plan.kv_bytes_per_token <= plan.kv_cache_bytes
    assert plan.kv_capacity_tokens % lim.tokens_per_block == 0
    # A 1920x1080 image stays 2040 tokens under the 4090d cap.
    assert plan.typical_request.image_tokens == 2040
    assert plan.concurrent_typical_requests == plan.kv_capacity_tokens // plan.typical_request.kv_tokens
    assert plan.fixed_bytes + plan.kv_cache_bytes <= plan.gpu_memory_bytes


def test_8b_on_a_24gb_card_with_the_2b_limits_fails_with_the_fix(released):
    result = CliRunner().invoke(app, ["plan", "--model", str(released["8b"]), "--gpu", "4090d"])
    assert result.exit_code == 1
    assert "8b checkpoint does not fit profile 4090d" in result.output
    assert "lower limits.max_batch_size to" in result.output


def test_a_card_too_small_for_the_weights(released, tmp_path):
    text = Path(load_profile("4090d").source).read_text()
    path = tmp_path / "tiny-card.toml"
    path.write_text(text.replace("memory_gib = 24", "memory_gib = 12"))
    plan = make_plan(open_checkpoint(released["8b"]), load_profile(str(path)))
    assert not plan.fits and "weights and buffers need" in plan.problems[0]


def test_plan_json(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "l40s", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is True and data["variant"] == "2b" and data["profile"] == "l40s"


def test_tiny_checkpoint_fits_the_demo_profile(tiny_ckpt):
    assert make_plan(open_checkpoint(tiny_ckpt), load_profile("4090d")).fits
