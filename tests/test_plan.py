"""Planner figures against values computed independently from the released configs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.cli import app
from qvl_trt.dtypes import WeightOnly
from qvl_trt.errors import PlanError
from qvl_trt.llm.engine import TABLE_ELEMENT_LIMIT
from qvl_trt.plan import (
    GIB,
    LoweredLimit,
    make_plan,
    plan_every_profile,
    plan_together,
    repository_kv_budgets,
)
from qvl_trt.profiles import load_profile, profile_names
from qvl_trt.testing.tiny_checkpoint import write_config_only
from qvl_trt.workload import Workload


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
    # The released checkpoints' tensors counted: 2.128 B / 4.438 B / 8.767 B parameters.
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
    # 1280x720 frames exceed the reference cap of 768 tokens a frame (786432 pixels): beta =
    # sqrt(720 x 1280 / 786432) = 1.0825, frames 640x1152 (20 x 36 tokens), 15 pairs.
    video = plan.typical_video
    assert video.visual_tokens == 15 * 20 * 36 == 10800 and not video.refused
    assert video.text_tokens == 64 + 15 * 9 and video.prompt_tokens <= lim.max_input_len
    assert video.kv_tokens == 11520  # 10800 + 199 + 512 = 11511, in blocks of 64
    assert plan.concurrent_typical_videos == min(plan.kv_capacity_tokens // 11520, 12) > 1
    assert plan.fixed_bytes + plan.kv_cache_bytes <= plan.gpu_memory_bytes


def test_8b_on_a_24gb_card_gets_its_own_limits(released):
    result = CliRunner().invoke(app, ["plan", "--model", str(released["8b"]), "--gpu", "4090d",
                                      "--weights", "int8"])
    assert result.exit_code == 0, result.output
    # The profile's 12 x 4 x 12288 rows of 4096 are 2,415,919,104 elements, above 2^31: no
    # bound in the container's TensorRT 10.14 without lookup_plugin, but the chat workload
    # keeps the bound its plans were sized with, so the batch goes down to 10.
    assert 12 * 4 * 12288 * 4096 > TABLE_ELEMENT_LIMIT > 10 * 4 * 12288 * 4096
    assert "max_batch_size 12 -> 10" in result.output
    assert "the chat workload's bound" in result.output
    plan = make_plan(open_checkpoint(released["8b"]), load_profile("4090d"), WeightOnly.INT8)
    assert plan.fits and plan.lowered == (LoweredLimit("max_batch_size", 12, 10),)
    assert plan.lowered_because == \
        "prompt table at 2,147,483,648 elements (the chat workload's bound)"
    assert plan.prompt_table_element_bound is None
    # The video workload sizes its table by the copy's cost, not by chat's bound.
    video = make_plan(open_checkpoint(released["8b"]), load_profile("4090d"), WeightOnly.INT8,
                      workload=Workload.VIDEO)
    assert video.fits and "chat workload" not in video.lowered_because
    # In FP16 the weights leave less memory: the batch goes on down to what the KV cache
    # holds typical requests for.
    fp16 = make_plan(open_checkpoint(released["8b"]), load_profile("4090d"))
    assert fp16.fits and fp16.lowered == (LoweredLimit("max_batch_size", 12, 6),)
    assert fp16.lowered_because == "KV cache below max_batch_size typical requests"
    assert fp16.concurrent_typical_requests >= 6
    seven = replace(load_profile("4090d"), limits=replace(fp16.limits, max_batch_size=7))
    assert make_plan(open_checkpoint(released["8b"]), seven).limits.max_batch_size == 6


def test_derived_limits_are_a_fixed_point(released):
    # The build plans again on the limits the plan derived (profile.json): nothing moves.
    for gpu, weights in (("4090d", WeightOnly.NONE), ("a10g", WeightOnly.NONE)):
        profile = load_profile(gpu)
        plan = make_plan(open_checkpoint(released["8b"]), profile, weights)
        again = make_plan(open_checkpoint(released["8b"]),
                          replace(profile, limits=plan.limits), weights)
        assert plan.lowered and again.fits and not again.lowered
        assert again.limits == plan.limits and again.kv_capacity_tokens == plan.kv_capacity_tokens


def test_the_shipped_limits_stay_for_the_2b_and_4b(released):
    # The profiles' limits are sized for the 2B and 4B: no plan of theirs lowers them.
    for name in profile_names():
        for variant in ("2b", "4b"):
            for weights in WeightOnly:
                plan = make_plan(open_checkpoint(released[variant]), load_profile(name), weights)
                assert plan.fits and not plan.lowered, (name, variant, weights)
                assert plan.limits == load_profile(name).limits


def test_the_context_is_halved_when_batch_1_does_not_fit(released, tmp_path):
    # An 8B in FP16 on a 21 GiB card: at 16384 tokens even one request leaves too little KV
    # cache; at 8192 (prompt 7168, visual tokens capped at 3 images of 2048) 3 requests fit.
    path = tmp_path / "21g.toml"
    path.write_text(Path(load_profile("4090d").source).read_text().replace(
        "memory_mib = 24564", "memory_mib = 21504"))
    card = load_profile(str(path))
    plan = make_plan(open_checkpoint(released["8b"]), card)
    assert plan.fits
    lowered = {c.key: (c.profile_value, c.value) for c in plan.lowered}
    assert lowered["max_seq_len"] == (16384, 8192)
    assert lowered["max_input_len"] == (14336, 7168)
    assert lowered["max_visual_tokens_per_request"] == (12288, 6144)
    assert lowered["video_max_tokens"] == (12288, 6144)
    assert lowered["max_batch_size"] == (12, 3) and plan.kv_capacity_tokens >= 8192
    # The clip is scaled into the smaller video budget rather than refused.
    assert not plan.typical_video.refused and plan.typical_video.visual_tokens <= 6144


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
    # 16384 halved while one 2048-token image fits a prompt: 8192, then 4096 (prompt 3584).
    assert "even at max_batch_size 1 and max_seq_len 4096" in plan.problems[0]
    assert "build with --weights int8 or int4 (weight-only)" in plan.problems[0]
    # INT4 takes the 8B onto it; then no smaller precision is left to name.
    assert make_plan(open_checkpoint(released["8b"]), load_profile(str(path)),
                     WeightOnly.INT4).fits
    path.write_text(text.replace("memory_mib = 24564", "memory_mib = 6144"))
    tiny = load_profile(str(path))
    refused = make_plan(open_checkpoint(released["8b"]), tiny, WeightOnly.INT4)
    assert "weights and buffers need" in refused.problems[0]
    assert "--weights" not in refused.problems[0]


def test_plan_json(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "l40s", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is True and data["variant"] == "2b" and data["profile"] == "l40s"


def test_tiny_checkpoint_fits_the_demo_profile(tiny_ckpt):
    assert make_plan(open_checkpoint(tiny_ckpt), load_profile("4090d")).fits


# The 8B's FP16 weights exceed the 16 GB card; every other (profile, variant) pair fits in
# FP16, the 8B on the 24 GB cards with limits lowered for it.
NOT_FOR_8B = {"4060ti"}


def test_every_shipped_profile_keeps_the_prompt_table_below_2_31(released):
    for name in profile_names():
        profile = load_profile(name)
        for variant, config in released.items():
            plan = make_plan(open_checkpoint(config), profile)
            assert plan.fits == (variant != "8b" or name not in NOT_FOR_8B), (name, variant)
            if plan.fits:
                assert plan.prompt_table_elements < 2**31, (name, variant)
                assert plan.prompt_table_rows_per_request == \
                    4 * plan.limits.max_visual_tokens_per_request


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
    result = CliRunner().invoke(app, ["plan", "-m", str(released[variant]), "-g", "all",
                                      "--weights", "none"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    rows = {c[0]: c for c in cells}
    assert [c[0] for c in cells] == profile_names()  # one row each, none wrapped
    notes = [line for line in lines if line.startswith("4060ti: ")]
    if variant == "8b":
        assert rows["4060ti"][2] == "no" and len(notes) == 1
        assert "weights and buffers need" in notes[0]
        assert "build with --weights int8 or int4" in notes[0]
        assert rows["4090d"][2:4] == ["yes", "6"]  # batch lowered from the profile's 12
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
                                          "--weights", "none", "--json"])
        assert result.exit_code == 0, result.output
        data[variant] = {row["profile"]: row for row in json.loads(result.output)}
        assert sorted(data[variant]) == profile_names()
    small = data["2b"]["4060ti"]
    assert small["fits"] is True and small["concurrent_typical_requests"] >= 2
    assert small["resident_bytes"] <= small["gpu_memory_bytes"] == 16380 * 2**20
    big = data["8b"]["4060ti"]
    assert big["fits"] is False
    assert "weights and buffers need" in big["problems"][0]
    assert "build with --weights int8 or int4" in big["problems"][0]
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


def test_2_31_elements_bound_the_table_through_lookup_plugin_and_for_chat(released, tmp_path,
                                                                         monkeypatch):
    # h100's batch 32 x 4 x four 2048-token images x 2048 wide = 2^31 for 2B.
    old = _profile_file(tmp_path, "h100", max_visual_tokens_per_request=8192)
    assert 32 * 4 * 8192 * 2048 == TABLE_ELEMENT_LIMIT
    # The long workload keeps the visual cap: no element bound without lookup_plugin.
    plan = make_plan(open_checkpoint(released["2b"]), old, workload=Workload.LONG)
    assert plan.fits and not plan.lowered and plan.prompt_table_element_bound is None
    assert plan.prompt_table_elements == TABLE_ELEMENT_LIMIT
    # The chat workload keeps the bound its plans were sized with.
    chat = make_plan(open_checkpoint(released["2b"]), old)
    assert chat.fits and chat.lowered == (LoweredLimit("max_batch_size", 32, 31),)
    assert chat.lowered_because == \
        "prompt table at 2,147,483,648 elements (the chat workload's bound)"
    # An engine whose lookup went through lookup_plugin (32-bit indexing) could not hold it.
    import qvl_trt.plan as planner

    real = planner.engine_build_config

    def with_lookup_plugin(*args, **kwargs):
        config = real(*args, **kwargs)
        config["plugin_config"]["lookup_plugin"] = "float16"
        return config

    monkeypatch.setattr(planner, "engine_build_config", with_lookup_plugin)
    plan = make_plan(open_checkpoint(released["2b"]), old, workload=Workload.LONG)
    assert plan.fits and plan.lowered == (LoweredLimit("max_batch_size", 32, 31),)
    assert plan.lowered_because == "prompt table at 2,147,483,648 elements (lookup_plugin)"
    assert plan.prompt_table_elements == 31 * 4 * 8192 * 2048
    # One row per request less per slot is below the limit again: nothing is lowered.
    below = _profile_file(tmp_path, "h100", max_visual_tokens_per_request=8191)
    assert not make_plan(open_checkpoint(released["2b"]), below).lowered


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


# --- weight-only precisions ---------------------------------------------------------------

def _8b_llm_bytes(bits: int) -> int:
    """The 8B's LLM weights by hand: per layer qkv 4096 -> 6144 (32 + 2 x 8 heads of 128),
    dense 4096 -> 4096, fc and gate 4096 -> 12288, proj 12288 -> 4096 at `bits` per weight
    plus one fp16 scale per output channel (none at 16 bits), four fp16 norms (2 x 4096 +
    2 x 128); the embedding and lm_head (151936 x 4096) and ln_f in fp16."""
    linears = 4096 * 6144 + 4096 * 4096 + 2 * 4096 * 12288 + 12288 * 4096
    scales = (6144 + 4096 + 2 * 12288 + 4096) * 2 if bits < 16 else 0
    layer = linears * bits // 8 + scales + (2 * 4096 + 2 * 128) * 2
    return 36 * layer + 2 * 151936 * 4096 * 2 + 4096 * 2


def test_llm_weights_in_each_precision_match_a_hand_count(released):
    ckpt = open_checkpoint(released["8b"])
    profile = load_profile("h200")
    for weights, bits in ((WeightOnly.NONE, 16), (WeightOnly.INT8, 8), (WeightOnly.INT4, 4)):
        assert make_plan(ckpt, profile, weights).llm_weight_bytes == _8b_llm_bytes(bits)
    # FP16 is the parameter count x 2, as before the precisions: the 8B ties nothing.
    assert _8b_llm_bytes(16) == ckpt.param_counts()["llm"] * 2
    # Break on purpose: without the per-channel scales the count is off by 36 x 38912 x 2.
    assert _8b_llm_bytes(8) - 36 * 38912 * 2 != make_plan(ckpt, profile,
                                                          WeightOnly.INT8).llm_weight_bytes
    # A tied checkpoint (2B) holds lm_head apart from the embedding in every precision.
    two = open_checkpoint(released["2b"])
    none, int8 = (make_plan(two, profile, w).llm_weight_bytes for w in (WeightOnly.NONE,
                                                                       WeightOnly.INT8))
    assert none == (two.param_counts()["llm"] + 151936 * 2048) * 2
    assert none - int8 == 28 * (2048 * 4096 + 2048 * 2048 + 3 * 2048 * 6144) \
        - 28 * (4096 + 2048 + 2 * 6144 + 2048) * 2


def test_feature_counts_are_padded_as_the_engine_pads_them(released):
    from qvl_trt.plan import llm_weight_bytes

    text = open_checkpoint(released["2b"]).text
    vision = open_checkpoint(released["2b"]).vision
    odd = replace(text, intermediate_size=6100)  # fc/gate out, proj in: padded to 6144
    padded = replace(text, intermediate_size=6144)
    for w in (WeightOnly.INT8, WeightOnly.INT4):
        assert llm_weight_bytes(odd, vision, w) == llm_weight_bytes(padded, vision, w)
    assert llm_weight_bytes(odd, vision, WeightOnly.NONE) < \
        llm_weight_bytes(padded, vision, WeightOnly.NONE)


def _cells(output: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in output.splitlines()
            if line.startswith("│")]
    return {r[0]: r[1:] for r in rows}


def test_plan_gpu_all_shows_each_precision(released):
    tables = {}
    for variant in ("2b", "4b", "8b"):
        result = CliRunner().invoke(app, ["plan", "-m", str(released[variant]), "-g", "all"])
        assert result.exit_code == 0, result.output
        tables[variant] = _cells(result.output)
        assert sorted(tables[variant]) == profile_names()
    # The 2B and 4B fit every card in every precision at the profiles' own limits.
    for variant in ("2b", "4b"):
        assert all("-" not in cells and "*" not in "".join(cells)
                   for cells in tables[variant].values())
    eight = tables["8b"]
    assert eight["4060ti"][1:] and eight["4060ti"][1] == "-"  # fp16: the weights alone
    ckpt = open_checkpoint(released["8b"])
    int4 = make_plan(ckpt, load_profile("4060ti"), WeightOnly.INT4)
    assert eight["4060ti"][3] == f"2 / {int4.kv_capacity_tokens:,}"
    # The KV budget by hand: 0.9 of what the INT4 weights (scales included) and the other
    # resident buffers leave of 16380 MiB, in whole 64-token blocks of 147456 bytes.
    others = int4.fixed_bytes - int4.llm_weight_bytes
    free = 16380 * 2**20 - others - _8b_llm_bytes(4)
    assert int4.kv_capacity_tokens == int(0.9 * free) // 147456 // 64 * 64 > 4096
    int8 = make_plan(ckpt, load_profile("4090d"), WeightOnly.INT8)
    assert eight["4090d"][2] == f"10* / {int8.kv_capacity_tokens:,}"
    assert int8.kv_capacity_tokens == int(0.9 * (24564 * 2**20 - int8.fixed_bytes)) \
        // 147456 // 64 * 64
    assert int8.fixed_bytes - int8.llm_weight_bytes + _8b_llm_bytes(8) == int8.fixed_bytes


def test_plan_weights_is_one_for_all_or_one_per_model(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "4090d",
                                      "--weights", "int8", "--weights", "int4"])
    assert result.exit_code == 1
    assert "2 --weights for 1 --model" in result.output
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-m",
                                      str(released["4b"]), "-g", "all"])
    assert result.exit_code == 1 and "--gpu all plans one --model" in result.output


# --- several models on one card -----------------------------------------------------------

def test_a_4b_and_an_8b_share_a_4090d_in_int8(released):
    models = [("4b", open_checkpoint(released["4b"]), WeightOnly.INT8, Workload.CHAT),
              ("8b", open_checkpoint(released["8b"]), WeightOnly.INT8, Workload.CHAT)]
    shared = plan_together(models, load_profile("4090d"))
    assert shared.fits, shared.problems
    four, eight = shared.plans
    # Alone each keeps 16384-token requests; together even batch 1 leaves one of them less KV
    # cache than that, so the context is halved and the batches lowered to what fits.
    for plan in shared.plans:
        assert plan.limits.max_seq_len == 8192 and plan.limits.max_batch_size == 3
        assert all(b >= plan.limits.max_seq_len for b in shared.kv_budgets)
    assert shared.fixed_bytes + sum(
        b * p.kv_bytes_per_token for b, p in zip(shared.kv_budgets, shared.plans, strict=True)
    ) <= 24564 * 2**20
    assert shared.kv_budgets == repository_kv_budgets(shared.plans)
    assert _safe_in_every_load_order(list(shared.plans), shared.kv_budgets)
    assert all(n >= 3 for n in shared.concurrent_typical_requests)
    # The CLI prints each one's share and KV budget.
    result = CliRunner().invoke(app, ["plan", "-m", f"4b={released['4b']}", "-m",
                                      f"8b={released['8b']}", "-g", "4090d", "--weights",
                                      "int8"])
    assert result.exit_code == 0, result.output
    cells = _cells(result.output)
    assert cells["4b (4b)"][:3] == ["int8", "3", "8192"]
    assert cells["8b (8b)"][4] == f"{shared.kv_budgets[1]:,}"
    assert cells["8b (8b)"][3] == f"{eight.fixed_bytes / GIB:.2f} GiB"
    kv = [b * p.kv_bytes_per_token for b, p in zip(shared.kv_budgets, shared.plans, strict=True)]
    assert cells["8b (8b)"][5] == f"{kv[1] / GIB:.2f} GiB"
    assert cells["together"] == ["", "", "", f"{shared.fixed_bytes / GIB:.2f} GiB", "",
                                 f"{sum(kv) / GIB:.2f} GiB", ""]
    assert "8b: limits lowered for this checkpoint" in result.output
    data = json.loads(CliRunner().invoke(app, [
        "plan", "-m", f"4b={released['4b']}", "-m", f"8b={released['8b']}", "-g", "4090d",
        "--weights", "int8", "--json"]).output)
    assert data["fits"] and [b["kv_budget_tokens"] for b in data["builds"]] == \
        list(shared.kv_budgets)


def test_models_that_do_not_fit_one_card_are_refused_in_one_line(released):
    result = CliRunner().invoke(app, ["plan", "-m", f"4b={released['4b']}", "-m",
                                      f"8b={released['8b']}", "-g", "4060ti", "--weights",
                                      "int8"])
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: 4b and 8b do not fit together on one "
                                                "4060ti (16.0 GiB)")
    assert "build with --weights int4" in line and line.endswith("serve them on separate GPUs")
    # INT4 takes both.
    assert CliRunner().invoke(app, [
        "plan", "-m", f"4b={released['4b']}", "-m", f"8b={released['8b']}", "-g", "4060ti",
        "--weights", "int4"]).exit_code == 0
    # A model that does not fit alone is named.
    result = CliRunner().invoke(app, ["plan", "-m", f"2b={released['2b']}", "-m",
                                      f"8b={released['8b']}", "-g", "4060ti"])
    assert result.exit_code == 1 and "error: 8b: weights and buffers need" in result.output


def test_saved_profiles_build_the_pair_for_its_card(released, tmp_path):
    result = CliRunner().invoke(app, [
        "plan", "-m", f"4b={released['4b']}", "-m", f"8b={released['8b']}", "-g", "4090d",
        "--weights", "int8", "--save-profiles", str(tmp_path / "profiles")])
    assert result.exit_code == 0, result.output
    saved = {n: tmp_path / "profiles" / f"4090d-{n}.toml" for n in ("4b", "8b")}
    assert f"wrote {saved['8b']}; build with: qvl-trt build --model {released['8b']} --gpu " \
        f"{saved['8b']} --weights int8" in " ".join(result.output.split())
    models = [(n, open_checkpoint(released[n]), WeightOnly.INT8, Workload.CHAT)
              for n in ("4b", "8b")]
    shared = plan_together(models, load_profile("4090d"))
    # What each build plans on its saved profile (alone on the card, as the build does)
    # keeps the pair's limits, and the repository of the two gets the pair's KV budgets.
    alone = [make_plan(ckpt, load_profile(str(saved[n])), w) for n, ckpt, w, _ in models]
    assert [p.limits for p in alone] == [p.limits for p in shared.plans]
    assert all(p.fits and not p.lowered for p in alone)
    assert repository_kv_budgets(alone) == shared.kv_budgets
    assert "# max_seq_len: 16384 in the profile" in saved["8b"].read_text()


# --- workloads ----------------------------------------------------------------------------

def test_the_video_workload_serves_the_whole_clip_on_the_h200(released):
    result = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "h200",
                                      "--workload", "video", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # The chat profile scales the clip into its 2048-token video budget; the video workload
    # gives it the checkpoint's 12288: the size its own processor makes (768 tokens a frame
    # at most: 640x1152 frames, 15 pairs of 20 x 36 tokens).
    chat = make_plan(open_checkpoint(released["2b"]), load_profile("h200"))
    assert chat.typical_video.visual_tokens == 1800
    assert data["typical_video"]["visual_tokens"] == 15 * 20 * 36 == 10800
    assert not data["typical_video"]["refused"]
    lim = data["limits"]
    assert lim["video_max_tokens"] == lim["max_visual_tokens_per_request"] == 12288
    # The chat profile's room for text (10240 - 2048) and for the answer (16384 - 10240) stay.
    assert (lim["max_input_len"], lim["max_seq_len"]) == (12288 + 8192, 12288 + 8192 + 6144)
    # Batch 48 at the caps would copy 48 x 4 x 12288 rows of 4096 bytes twice per step: the
    # planner lowers it until the copy adds at most 25% to a decode step, and says so.
    assert lim["max_batch_size"] == 30
    assert data["lowered"] == [{"key": "max_batch_size", "profile_value": 48, "value": 30}]
    plan = make_plan(open_checkpoint(released["2b"]), load_profile("h200"),
                     workload=Workload.VIDEO)
    copy = 30 * 4 * 12288 * 2048 * 2
    assert plan.prompt_table_copy_bytes_per_step == copy
    kv = 30 * (12288 + 64 + 512) * plan.kv_bytes_per_token  # 12864: whole 64-token blocks
    assert plan.decode_step_bytes_at_caps == plan.llm_weight_bytes + kv
    assert plan.table_copy_share_of_step == 2 * copy / (plan.llm_weight_bytes + kv) <= 0.25
    assert plan.table_copy_share_of_weights == pytest.approx(2 * copy / plan.llm_weight_bytes)
    one_more = make_plan(open_checkpoint(released["2b"]), replace(
        load_profile("h200"), limits=replace(plan.limits, max_batch_size=31)),
        workload=Workload.VIDEO)
    # At 31 the copy would add more than 25%: the planner takes 30 again.
    assert one_more.lowered == (LoweredLimit("max_batch_size", 31, 30),)
    assert one_more.lowered_because.startswith("the prompt-table copy at the caps would add 25.")
    assert plan.lowered_because.startswith("the prompt-table copy at the caps would add 25.")
    # The typical mix: the KV cache holds 30 clips, each copying its own 4 x 10800 rows.
    assert plan.prompt_table_copy_bytes_typical == 30 * 10800 * 4 * 2048 * 2
    text = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-g", "h200",
                                    "--workload", "video"]).output
    assert "video workload: max_input_len 10240 -> 20480" in text
    assert "max_batch_size 48 -> 30; the build uses them" in " ".join(text.split())
    assert "weight read" in text and "table copy per step" in text


@pytest.mark.parametrize("variant", ["2b", "4b", "8b"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_long_workload_gives_256k_on_the_hopper_cards(released, variant, gpu):
    ckpt = open_checkpoint(released[variant])
    plan = make_plan(ckpt, load_profile(gpu), workload=Workload.LONG)
    assert plan.fits, plan.problems
    lim = plan.limits
    assert lim.max_seq_len == ckpt.text.max_position_embeddings == 262144
    assert lim.max_input_len == 262144 - (16384 - 10240)  # the profile's room for the answer
    # One full-length sequence beside a batch of typical requests, and the MRoPE table of
    # every slot at that length (fp32 cos and sin of 128 dims per position).
    assert plan.kv_capacity_tokens >= 262144 + (lim.max_batch_size - 1) * \
        plan.typical_request.kv_tokens
    assert plan.full_sequences == plan.kv_capacity_tokens // 262144 >= 1
    assert plan.mrope_table_bytes == lim.max_batch_size * 262144 * 128 * 4
    result = CliRunner().invoke(app, ["plan", "-m", str(released[variant]), "-g", gpu,
                                      "--workload", "long"])
    assert "full-length sequences" in result.output
    assert "long workload: max_input_len 10240 -> 256000, max_seq_len 16384 -> 262144" in \
        result.output


def test_the_long_workload_falls_back_to_128k_and_says_why(released):
    # A 24 GB card holds no 256K sequence of the 2B (28 GiB of KV): 128K at a lower batch.
    plan = make_plan(open_checkpoint(released["2b"]), load_profile("4090d"),
                     workload=Workload.LONG)
    assert plan.fits and plan.limits.max_seq_len == 131072
    assert plan.kv_capacity_tokens >= 131072 + (plan.limits.max_batch_size - 1) * \
        plan.typical_request.kv_tokens
    keys = {c.key: (c.profile_value, c.value) for c in plan.lowered}
    assert keys["max_seq_len"] == (262144, 131072) and keys["max_batch_size"][0] == 12
    assert plan.lowered_because.startswith("KV cache below one 262144-token sequence; ")
    # Where not even 128K fits, the plan refuses with the fix.
    small = make_plan(open_checkpoint(released["8b"]), load_profile("4090d"),
                      workload=Workload.LONG)
    assert not small.fits
    assert "less than one 131072-token sequence" in small.problems[0]
    assert "--workload chat" in small.problems[0]


def test_a_short_context_checkpoint_has_no_long_workload(released, tmp_path):
    config = json.loads((released["2b"] / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 32768
    short = tmp_path / "short"
    short.mkdir()
    for f in released["2b"].iterdir():
        (short / f.name).write_text(f.read_text())
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=r"max_position_embeddings \(32768\) is below 131072"):
        make_plan(open_checkpoint(short), load_profile("h200"), workload=Workload.LONG)


@pytest.mark.parametrize("workload", [Workload.VIDEO, Workload.LONG])
def test_workload_limits_are_a_fixed_point(released, workload):
    # The build plans again on the limits the plan derived (profile.json): nothing moves.
    for variant, gpu in (("2b", "h200"), ("8b", "h100"), ("2b", "4090d")):
        profile = load_profile(gpu)
        plan = make_plan(open_checkpoint(released[variant]), profile, workload=workload)
        again = make_plan(open_checkpoint(released[variant]),
                          replace(profile, limits=plan.limits), workload=workload)
        assert again.limits == plan.limits and not again.lowered and not again.raised


def test_the_chat_workload_is_the_profile(released):
    for gpu in ("h200", "4090d", "4060ti"):
        for variant in ("2b", "8b"):
            ckpt = open_checkpoint(released[variant])
            assert make_plan(ckpt, load_profile(gpu), workload=Workload.CHAT) == \
                make_plan(ckpt, load_profile(gpu))
            assert make_plan(ckpt, load_profile(gpu)).raised == ()


def test_a_chat_and_a_video_build_of_one_checkpoint_share_an_h200(released):
    ckpt = open_checkpoint(released["2b"])
    result = CliRunner().invoke(app, ["plan", "-m", f"chat={released['2b']}", "-m",
                                      f"video={released['2b']}", "-g", "h200", "--workload",
                                      "chat", "--workload", "video", "--json"])
    assert result.exit_code == 0, result.output
    builds = {b["name"]: b for b in json.loads(result.output)["builds"]}
    assert builds["chat"]["workload"] == "chat" and builds["video"]["workload"] == "video"
    assert builds["chat"]["limits"]["max_visual_tokens_per_request"] == 2048
    assert builds["video"]["typical_video"]["visual_tokens"] == 10800
    shared = plan_together([("chat", ckpt, WeightOnly.NONE, Workload.CHAT),
                            ("video", ckpt, WeightOnly.NONE, Workload.VIDEO)],
                           load_profile("h200"))
    assert [p.limits.max_batch_size for p in shared.plans] == [
        b["limits"]["max_batch_size"] for b in builds.values()]
    assert sum(shared.kv_budgets) <= make_plan(ckpt, load_profile("h200")).kv_capacity_tokens
    bad = CliRunner().invoke(app, ["plan", "-m", str(released["2b"]), "-m", str(released["4b"]),
                                   "-m", str(released["8b"]), "-g", "h200", "--workload",
                                   "chat", "--workload", "video"])
    assert bad.exit_code == 1 and "2 --workload for 3 --model" in bad.output


@pytest.mark.parametrize("variant", ["2b", "4b", "8b"])
def test_the_video_workload_serves_the_whole_clip_wherever_it_fits(released, variant):
    # The 4060 Ti's images stop at 768x768, below the 786432-pixel frames the processor
    # keeps: the video build raises the vision engine's largest input to one such frame.
    fitting = [p for _, p in plan_every_profile(open_checkpoint(released[variant]),
                                                workload=Workload.VIDEO) if p.fits]
    assert len(fitting) >= 10
    for plan in fitting:
        assert plan.typical_video.visual_tokens == 10800, plan.profile
        assert plan.limits.video_max_pixels_per_frame >= 768 * 1024 <= \
            plan.limits.vision_max_pixels
