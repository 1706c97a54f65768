"""Planner figures against values computed independently from the released configs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.cli import app
from qvl_trt.errors import PlanError
from qvl_trt.plan import GIB, MAX_TABLE_ELEMENTS, make_plan, repository_kv_budgets
from qvl_trt.profiles import load_profile, profile_names
from qvl_trt.testing.tiny_checkpoint import write_config_only


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
    # Hand-computed: batch 12 x (1 + 3 DeepStack) x 12288 visual tokens; 2B rows are 2048 wide.
    assert lim.max_visual_tokens_per_request == 12288
    assert plan.prompt_table_rows == 12 * 4 * 12288 == 589824
    assert plan.prompt_table_rows_per_request == 4 * 12288
    assert plan.prompt_table_elements == 589824 * 2048 == 1207959552
    assert plan.prompt_table_bytes == 2 * 1207959552
    # Every slot at the cap: the whole table crosses the device every step.
    assert plan.prompt_table_copy_bytes_per_step == 12 * 4 * 12288 * 2048 * 2
    assert plan.mrope_table_bytes_per_request == lim.max_seq_len * 128 * 4
    # /dev/shm per request: uint8 pixels (4 patches of 1536 bytes a token) and int64 position
    # ids twice, the MRoPE table once, the prompt table three times.
    assert plan.shm_bytes == 12 * (2 * 12288 * 4 * 1536 + 2 * 3 * 14336 * 8
                                   + 16384 * 128 * 4 + 3 * 4 * 12288 * 2048 * 2)
    assert plan.kv_capacity_tokens * plan.kv_bytes_per_token <= plan.kv_cache_bytes
    assert plan.kv_capacity_tokens % lim.tokens_per_block == 0
    # A 1920x1080 image stays 2040 tokens under the 4090d cap.
    assert plan.typical_request.visual_tokens == 2040 and not plan.typical_request.refused
    assert plan.concurrent_typical_requests == plan.kv_capacity_tokens // plan.typical_request.kv_tokens
    # 30 frames of 1280x720 exceed the 25165824-pixel video budget: beta = sqrt(30 x 720 x
    # 1280 / 25165824) = 1.0486, frames 672x1216 (21 x 38 tokens), 15 pairs of frames.
    video = plan.typical_video
    assert video.visual_tokens == 15 * 21 * 38 == 11970 and not video.refused
    assert video.text_tokens == 64 + 15 * 9 and video.prompt_tokens <= lim.max_input_len
    assert video.kv_tokens == 12736  # 11970 + 199 + 512 = 12681, in blocks of 64
    assert plan.concurrent_typical_videos == min(plan.kv_capacity_tokens // 12736, 12) > 1
    assert plan.fixed_bytes + plan.kv_cache_bytes <= plan.gpu_memory_bytes


def test_8b_on_a_24gb_card_with_the_2b_limits_fails_with_the_fix(released):
    result = CliRunner().invoke(app, ["plan", "--model", str(released["8b"]), "--gpu", "4090d"])
    assert result.exit_code == 1
    assert "8b checkpoint does not fit profile 4090d" in result.output
    # 12 x 4 x 12288 rows of 4096: the video-sized table of the 2B/4B limits.
    assert "the prompt table holds 2,415,919,104 elements" in result.output
    assert "lower limits.max_visual_tokens_per_request or limits.max_batch_size" in result.output


def test_a_profile_without_video_refuses_the_typical_clip(released, tmp_path):
    text = Path(load_profile("4090d").source).read_text()
    path = tmp_path / "no-video.toml"
    path.write_text(text.replace("max_videos_per_request = 1", "max_videos_per_request = 0")
                    .replace("max_visual_tokens_per_request = 12288",
                             "max_visual_tokens_per_request = 4096"))
    plan = make_plan(open_checkpoint(released["2b"]), load_profile(str(path)))
    assert plan.fits and plan.concurrent_typical_videos == 0
    assert plan.typical_video.refused == "limits.max_videos_per_request is 0"
    # A budget of 4096 tokens scales the clip's frames down (384x704) rather than refusing it.
    path.write_text(text.replace("video_max_tokens = 12288", "video_max_tokens = 4096")
                    .replace("max_visual_tokens_per_request = 12288",
                             "max_visual_tokens_per_request = 8192"))
    plan = make_plan(open_checkpoint(released["2b"]), load_profile(str(path)))
    assert plan.typical_video.visual_tokens == 15 * 12 * 22 and not plan.typical_video.refused
    # More frames than the profile samples: refused, naming the limit.
    path.write_text(text.replace("video_max_frames = 64", "video_max_frames = 16"))
    plan = make_plan(open_checkpoint(released["2b"]), load_profile(str(path)))
    assert plan.typical_video.refused == "30 frames, above limits.video_max_frames (16)"
    text_out = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", str(path)]).output
    assert "refused, 30 frames, above" in text_out and "limits.video_max_frames (16)" in text_out


def test_a_card_too_small_for_the_weights(released, tmp_path):
    text = Path(load_profile("4090d").source).read_text()
    path = tmp_path / "tiny-card.toml"
    path.write_text(text.replace("memory_mib = 24564", "memory_mib = 12288"))
    plan = make_plan(open_checkpoint(released["8b"]), load_profile(str(path)))
    assert not plan.fits and "weights and buffers need" in plan.problems[0]


def test_plan_json(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "l40s", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is True and data["variant"] == "2b" and data["profile"] == "l40s"


def test_tiny_checkpoint_fits_the_demo_profile(tiny_ckpt):
    assert make_plan(open_checkpoint(tiny_ckpt), load_profile("4090d")).fits


# The 8B checkpoint does not fit these profiles' limits (their limits are sized for 2B/4B,
# or 16 GB is below the 8B weights); every other (profile, variant) pair fits.
NOT_FOR_8B = {"3090", "4060ti", "4090", "4090d", "a10g", "l4"}


def test_every_shipped_profile_keeps_the_prompt_table_below_2_31(released):
    for name in profile_names():
        profile = load_profile(name)
        for variant, config in released.items():
            plan = make_plan(open_checkpoint(config), profile)
            assert plan.fits == (variant != "8b" or name not in NOT_FOR_8B), (name, variant)
            if plan.fits:
                assert plan.prompt_table_elements < 2**31, (name, variant)
                assert plan.prompt_table_rows_per_request == \
                    4 * profile.limits.max_visual_tokens_per_request


def test_the_planner_starts_from_the_memory_the_driver_reports(released):
    # An A10G exposes 23028 MiB, not 24 GiB: the plan's total and what is left for the KV
    # cache follow the profile's memory_mib.
    a10g = load_profile("a10g")
    plan = make_plan(open_checkpoint(released["2b"]), a10g)
    assert plan.gpu_memory_bytes == 23028 * 2**20 < 24 * GIB
    assert plan.kv_cache_bytes == int(0.9 * (plan.gpu_memory_bytes - plan.fixed_bytes))
    assert plan.resident_bytes == plan.fixed_bytes + plan.kv_cache_bytes <= plan.gpu_memory_bytes


@pytest.mark.parametrize("variant", ["2b", "4b", "8b"])
def test_plan_gpu_all_prints_one_row_per_profile(released, variant):
    result = CliRunner().invoke(app, ["plan", "-m", str(released[variant]), "-g", "all"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    rows = {c[0]: c for c in cells}
    assert [c[0] for c in cells] == profile_names()  # one row each, none wrapped
    notes = [line for line in lines if line.startswith("4060ti: ")]
    if variant == "8b":
        assert rows["4060ti"][2] == "no" and len(notes) == 1
        assert "weights and buffers need" in notes[0]
        assert "lower limits.max_batch_size" in notes[0]
    else:
        assert rows["4060ti"][2] == "yes" and not notes
    # Each "no" row has its reason below the table, and only those.
    refused = {name for name, c in rows.items() if c[2] == "no"}
    assert refused == {line.split(":")[0] for line in lines[len(lines) - len(refused):]}
    assert refused == (NOT_FOR_8B if variant == "8b" else set())


def test_plan_gpu_all_json(released):
    data = {}
    for variant in ("2b", "8b"):
        result = CliRunner().invoke(app, ["plan", "-m", str(released[variant]), "-g", "all",
                                          "--json"])
        assert result.exit_code == 0, result.output
        data[variant] = {row["profile"]: row for row in json.loads(result.output)}
        assert sorted(data[variant]) == profile_names()
    small = data["2b"]["4060ti"]
    assert small["fits"] is True and small["concurrent_typical_requests"] >= 2
    assert small["resident_bytes"] <= small["gpu_memory_bytes"] == 16380 * 2**20
    big = data["8b"]["4060ti"]
    assert big["fits"] is False
    assert "weights and buffers need" in big["problems"][0]
    assert "lower limits.max_batch_size" in big["problems"][0]
    # The 8B weights alone (vision + LLM, fp16) exceed the card's 16380 MiB.
    counts = open_checkpoint(released["8b"]).param_counts()
    assert (counts["vision"] + counts["llm"]) * 2 > 16380 * 2**20


def test_the_4060ti_refuses_the_8b_for_its_memory_alone(released, tmp_path):
    # Break on purpose: the same limits on a card with twice the memory take the 8B.
    text = Path(load_profile("4060ti").source).read_text()
    assert "memory_mib = 16380" in text
    path = tmp_path / "4060ti-32g.toml"
    path.write_text(text.replace("memory_mib = 16380", "memory_mib = 32760"))
    assert make_plan(open_checkpoint(released["8b"]), load_profile(str(path))).fits
    assert not make_plan(open_checkpoint(released["8b"]), load_profile("4060ti")).fits


def _profile_file(tmp_path, name, **limits):
    text = Path(load_profile(name).source).read_text()
    for key, value in limits.items():
        old = f"{key} = {getattr(load_profile(name).limits, key)}"
        assert old in text
        text = text.replace(old, f"{key} = {value}")
    path = tmp_path / f"{name}-edited.toml"
    path.write_text(text)
    return load_profile(str(path))


def test_a_prompt_table_at_2_31_elements_is_refused(released, tmp_path):
    # The old sizing: h100's batch 32 x 4 x four 2048-token images x 2048 wide = 2^31 for 2B.
    old = _profile_file(tmp_path, "h100", max_visual_tokens_per_request=8192)
    plan = make_plan(open_checkpoint(released["2b"]), old)
    assert plan.prompt_table_elements == 32 * 4 * 8192 * 2048 == MAX_TABLE_ELEMENTS
    assert not plan.fits and "at or above 2^31" in plan.problems[0]
    assert "lower limits.max_visual_tokens_per_request or limits.max_batch_size" in plan.problems[0]
    # One row per request less per slot is below the limit again.
    below = _profile_file(tmp_path, "h100", max_visual_tokens_per_request=8191)
    assert make_plan(open_checkpoint(released["2b"]), below).fits


def test_plan_shows_table_and_kv_budget(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["4b"]), "-g", "h200", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # 48 x 4 x 2048 rows of 2560 halves.
    assert data["prompt_table_rows"] == 393216 and data["prompt_table_rows_per_request"] == 8192
    assert data["prompt_table_bytes"] == data["prompt_table_copy_bytes_per_step"] == \
        393216 * 2560 * 2
    assert data["kv_capacity_tokens"] > 0 and data["kv_capacity_tokens"] % 64 == 0
    text = CliRunner().invoke(app, ["plan", "-m", str(released["4b"]), "-g", "h200"]).output
    for label in ("table rows per request", "table copy per step", "KV budget",
                  "max_tokens_in_paged_kv_cache"):
        assert label in text


# --- KV budgets in one server -------------------------------------------------------------

KV_BYTES = 128 * 1024  # per token, a round figure for the hand computations


def _synthetic(plan, *, fixed_gib: float, batch: int = 32, gpu_gib: int = 100,
               fraction: float = 0.9, model: str = "a"):
    """`plan` with every resident buffer in the LLM weights: fixed_bytes = fixed_gib."""
    zero = dict(vision_weight_bytes=0, vision_activation_bytes=0, llm_activation_bytes=0,
                runtime_overhead_bytes=0, prompt_table_bytes=0, mrope_table_bytes=0)
    limits = replace(plan.limits, max_batch_size=batch, max_seq_len=16384, tokens_per_block=64,
                     kv_cache_free_gpu_mem_fraction=fraction)
    return replace(plan, **zero, model=model, limits=limits, gpu_memory_bytes=gpu_gib * GIB,
                   llm_weight_bytes=int(fixed_gib * GIB), kv_bytes_per_token=KV_BYTES)


def _safe_in_every_load_order(plans, budgets) -> bool:
    """The loaded-last build's fraction of what is free still exceeds its max_tokens."""
    left = plans[0].gpu_memory_bytes - sum(p.fixed_bytes for p in plans)
    kv = [b * p.kv_bytes_per_token for b, p in zip(budgets, plans, strict=True)]
    return all(p.limits.kv_cache_free_gpu_mem_fraction * (left - (sum(kv) - own)) >= own
               for p, own in zip(plans, kv, strict=True))


@pytest.fixture(scope="module")
def base_plan(released):
    return make_plan(open_checkpoint(released["2b"]), load_profile("h100"))


def test_one_build_alone_gets_the_fraction_of_what_is_left(base_plan):
    plan = _synthetic(base_plan, fixed_gib=20)
    # 0.9 x (100 - 20) GiB / 128 KiB per token = 589824 tokens, 9216 blocks of 64.
    assert repository_kv_budgets([plan]) == (589824,)
    # The same figure make_plan reports for a real build alone on its card.
    assert repository_kv_budgets([base_plan]) == (base_plan.kv_capacity_tokens,)


def test_builds_in_one_server_split_what_is_left(base_plan):
    a = _synthetic(base_plan, fixed_gib=20, model="a")
    b = _synthetic(base_plan, fixed_gib=20, model="b")
    # 0.9 x (100 - 40) GiB, half each: 27 GiB = 221184 tokens.
    assert repository_kv_budgets([a, b]) == (221184, 221184)
    # In proportion to max_batch_size x max_seq_len x KV bytes: 32 vs 16 -> 36 and 18 GiB.
    small = _synthetic(base_plan, fixed_gib=20, batch=16, model="b")
    budgets = repository_kv_budgets([a, small])
    assert budgets == (294912, 147456)
    assert _safe_in_every_load_order([a, small], budgets)
    # Break on purpose: each build taking the fraction of everything, as
    # kv_cache_free_gpu_mem_fraction alone does for whichever loads first, is not safe.
    alone = repository_kv_budgets([a])[0] * 60 // 80
    assert not _safe_in_every_load_order([a, small], (alone, alone))


def test_builds_that_do_not_fit_together(base_plan):
    crowd = [_synthetic(base_plan, fixed_gib=49, model=m) for m in ("a", "b")]
    # 0.9 x 2 GiB / 2 per build = 7372 tokens, fewer than max_seq_len 16384.
    with pytest.raises(PlanError, match=r"builds a \(2b, h100\), b \(2b, h100\) do not fit "
                                        r"together on one 100 GiB GPU.*separate GPUs") as err:
        repository_kv_budgets(crowd)
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="do not fit together"):
        repository_kv_budgets([_synthetic(base_plan, fixed_gib=60, model=m) for m in "ab"])
    with pytest.raises(PlanError, match="GPUs of different memory sizes"):
        repository_kv_budgets([_synthetic(base_plan, fixed_gib=20),
                               _synthetic(base_plan, fixed_gib=20, gpu_gib=80)])


def test_two_real_builds_share_an_h200(released):
    h200 = load_profile("h200")
    plans = [make_plan(open_checkpoint(released[v]), h200) for v in ("2b", "4b")]
    budgets = repository_kv_budgets(plans)
    assert all(b < p.kv_capacity_tokens for b, p in zip(budgets, plans, strict=True))
    assert _safe_in_every_load_order(plans, budgets)


def test_readme_profile_table_lists_every_card_with_the_variants_that_fit(released):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0].strip("`") in profile_names():
            table[cells[0].strip("`")] = (int(cells[3]), cells[5], int(cells[6]))
    assert sorted(table) == profile_names()
    for name, (mib, variants, clip) in table.items():
        profile = load_profile(name)
        fits = [v.upper() for v, c in released.items()
                if make_plan(open_checkpoint(c), profile).fits]
        video = make_plan(open_checkpoint(released["2b"]), profile).typical_video
        assert (mib, variants, clip) == (profile.gpu.memory_mib, ", ".join(fits),
                                         video.visual_tokens), name
        assert not video.refused, name
