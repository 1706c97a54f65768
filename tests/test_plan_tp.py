"""The planner at a tensor-parallel size: one card of the profile a rank, planned for rank 0's
card (its share of the language model, the whole vision model)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.cli import app
from qvl_trt.dtypes import WeightOnly
from qvl_trt.errors import ConfigError, PlanError
from qvl_trt.llm.convert import convert_checkpoint, rank_file
from qvl_trt.plan import (
    RUNTIME_OVERHEAD_BYTES,
    VISION_PROCESS_OVERHEAD_BYTES,
    check_fits,
    llm_weight_bytes,
    make_plan,
)
from qvl_trt.profiles import load_profile
from qvl_trt.testing.tiny_checkpoint import write_config_only

MIB = 2**20


@pytest.fixture(scope="module")
def eight_b(tmp_path_factory) -> Path:
    return write_config_only(tmp_path_factory.mktemp("released") / "8b", "8b")


def _8b_rank_bytes(tp: int, bits: int = 16) -> int:
    """One rank's 8B LLM weights by hand: q, k, v (32 + 2 x 8 heads of 128), dense, fc, gate
    and proj each 1/tp of the layer's linears at `bits` per weight plus one fp16 scale per
    output channel of the rank (none at 16 bits; dense and proj split their input, so keep all
    4096 outputs); the four norms, the embedding and ln_f whole; lm_head 1/tp of the
    151936-row vocabulary; all fp16."""
    linears = (4096 * 6144 + 4096 * 4096 + 2 * 4096 * 12288 + 12288 * 4096) // tp
    scales = (6144 // tp + 4096 + 2 * 12288 // tp + 4096) * 2 if bits < 16 else 0
    layer = linears * bits // 8 + scales + (2 * 4096 + 2 * 128) * 2
    return 36 * layer + (151936 + 151936 // tp) * 4096 * 2 + 4096 * 2


def test_an_8b_in_fp16_refused_by_one_16gb_card_fits_two(eight_b):
    ckpt, card = open_checkpoint(eight_b), load_profile("4060ti")
    assert card.memory_bytes == 16380 * MIB
    with pytest.raises(PlanError, match=r"does not fit profile 4060ti: weights and buffers"):
        check_fits(make_plan(ckpt, card))
    plan = make_plan(ckpt, card, tp_size=2)
    assert plan.fits and plan.tp_size == 2 and plan.lowered == ()
    # Rank 0's card: half the decoder and lm_head, the embedding whole ...
    assert plan.llm_weight_bytes == _8b_rank_bytes(2) == 8_813_373_440
    for weights, bits in ((WeightOnly.INT8, 8), (WeightOnly.INT4, 4)):
        assert llm_weight_bytes(ckpt.text, ckpt.vision, weights, 2) == _8b_rank_bytes(2, bits)
    # ... and the vision model, its process and the TensorRT-LLM rank's runtime whole.
    one = make_plan(ckpt, load_profile("h200"))
    assert plan.vision_weight_bytes == one.vision_weight_bytes
    assert plan.runtime_overhead_bytes == RUNTIME_OVERHEAD_BYTES + VISION_PROCESS_OVERHEAD_BYTES
    # KV: each rank holds 4 of the 8 KV heads: 2 (K, V) x 36 layers x 4 x 128 x 2 bytes.
    assert plan.kv_bytes_per_token == 2 * 36 * 4 * 128 * 2 == 73_728
    # The budget: 0.9 of what the fixed bytes leave of 16380 MiB, in whole 64-token blocks.
    fraction = Fraction(card.limits.kv_cache_free_gpu_mem_fraction)
    assert plan.kv_cache_bytes == math.floor(fraction * (16380 * MIB - plan.fixed_bytes))
    assert plan.kv_capacity_tokens == plan.kv_cache_bytes // 73_728 // 64 * 64 == 63_680
    assert plan.concurrent_typical_requests == 63_680 // plan.typical_request.kv_tokens == 55
    # Break on purpose: the same card with the KV heads left whole (the TP-1 bytes per token)
    # would hold half the tokens.
    assert plan.kv_cache_bytes // one.kv_bytes_per_token // 64 * 64 == 31_808


def test_tp_1_is_the_plan_as_before(eight_b):
    ckpt, card = open_checkpoint(eight_b), load_profile("4090d")
    assert make_plan(ckpt, card, tp_size=1) == make_plan(ckpt, card)
    assert make_plan(ckpt, card).llm_weight_bytes == _8b_rank_bytes(1)


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_weights_are_the_converted_rank_files_tensors(tiny_ckpt, tmp_path, tp):
    safetensors = pytest.importorskip("safetensors")
    ckpt = open_checkpoint(tiny_ckpt)
    out = convert_checkpoint(tiny_ckpt, tmp_path / "out", max_seq_len=64, dtype="float16",
                             tp_size=tp).out
    for rank in range(tp):
        with safetensors.safe_open(out / rank_file(rank), framework="np") as f:
            stored = sum(f.get_tensor(k).nbytes for k in f.keys())
        assert stored == llm_weight_bytes(ckpt.text, ckpt.vision, WeightOnly.NONE, tp)
    # Break on purpose: the TP-1 figure is not a TP-2 rank's.
    if tp == 2:
        assert stored != llm_weight_bytes(ckpt.text, ckpt.vision, WeightOnly.NONE, 1)


def test_a_tp_size_the_heads_do_not_take_is_a_one_line_error(tiny_ckpt):
    # The tiny checkpoint has 4 attention heads and 2 KV heads: conversion's own rule.
    ckpt, card = open_checkpoint(tiny_ckpt), load_profile("4090d")
    with pytest.raises(ConfigError, match=r"^tensor-parallel size 4 does not divide the "
                       r"model's 2 KV heads; use one of \[1, 2\]$"):
        make_plan(ckpt, card, tp_size=4)
    result = CliRunner().invoke(app, ["plan", "-m", str(tiny_ckpt), "-g", "4090d",
                                      "--tp-size", "3"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "error: tensor-parallel size 3 does not divide the model's 4 attention heads; use "
        "one of [1, 2]"]


def test_plan_cli_plans_the_tp_size(eight_b, tmp_path):
    result = CliRunner().invoke(app, ["plan", "-m", str(eight_b), "-g", "4060ti",
                                      "--tp-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] and data["tp_size"] == 2 and data["kv_capacity_tokens"] == 63_680
    table = CliRunner().invoke(app, ["plan", "-m", str(eight_b), "-g", "4060ti",
                                     "--tp-size", "2"], terminal_width=200)
    assert "tensor-parallel size 2: rank 0's card" in table.output
    refused = CliRunner().invoke(app, ["plan", "-m", str(eight_b), "-g", "4060ti"])
    assert refused.exit_code != 0 and "does not fit profile 4060ti" in refused.output
    both = CliRunner().invoke(app, ["plan", "-m", f"a={eight_b}", "-m", f"b={eight_b}",
                                    "-g", "h200", "--tp-size", "2"])
    assert both.exit_code != 0 and "--tp-size plans one --model" in both.output


def test_the_build_plans_its_tp_size(eight_b, tmp_path):
    out = tmp_path / "b"
    run_build(BuildOptions(str(eight_b), "4060ti", tp_size=2), out, only=(Stage.PLAN,))
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["tp_size"] == 2 and plan["kv_capacity_tokens"] == 63_680
    with pytest.raises(PlanError, match="does not fit profile 4060ti"):
        run_build(BuildOptions(str(eight_b), "4060ti"), tmp_path / "one", only=(Stage.PLAN,))


def test_a_tp_builds_repository_gets_rank_0s_kv_budget(tiny_ckpt, tmp_path):
    from qvl_trt.manifest import BuildFolder
    from qvl_trt.triton.options import BuildInput, Flavor, RepoOptions
    from qvl_trt.triton.repository import write_repo

    build = tmp_path / "build"
    run_build(BuildOptions(str(tiny_ckpt), "4090d", tp_size=2), build,
              only=(Stage.LLM_CHECKPOINT,))
    write_repo([BuildInput(build)], tmp_path / "repo", RepoOptions(flavor=Flavor.REFERENCE))
    info = json.loads((tmp_path / "repo" / "ensemble" / "1" / "build.json").read_text())
    ckpt, profile = open_checkpoint(tiny_ckpt), BuildFolder(build).profile()
    assert info["tp_size"] == 2
    assert info["kv_cache_tokens"] == make_plan(ckpt, profile, tp_size=2).kv_capacity_tokens
    # Break on purpose: the TP-1 plan of the same card holds fewer tokens a rank.
    assert info["kv_cache_tokens"] > make_plan(ckpt, profile).kv_capacity_tokens
