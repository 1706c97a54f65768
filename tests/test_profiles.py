"""GPU profiles: the shipped ones load; a bad user file is rejected naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.profiles import (
    TrtEdition,
    gpu_product_label,
    load_profile,
    profile_argument,
    profile_names,
    profile_toml,
)

REQUIRED = {"4090d", "4090", "3090", "a10g", "l4", "l40s", "a100-40g", "a100-80g", "h100", "h200",
            "4060ti", "5090", "h20", "l20"}

# nvidia-smi memory.total (MiB) for each shipped card, held here apart from the profiles.
DRIVER_MIB = {
    "4090": (24564, "github.com/RLinf/RLinf/issues/255"),
    # No 4090 D nvidia-smi table found; the 4090's 24 GB GDDR6X figure (a GPU listing gives
    # 24564 MB for the 4090 D).
    "4090d": (24564, "github.com/RLinf/RLinf/issues/255 (RTX 4090)"),
    "3090": (24576, "github.com/noonghunna/club-3090/issues/1128"),
    "a10g": (23028, "github.com/NVIDIA/DCGM/issues/232"),
    "l4": (23034, "github.com/modal-labs/modal-client/pull/2797"),
    "l40s": (46068, "github.com/modal-labs/modal-client/pull/2797"),
    "a100-40g": (40960, "github.com/modal-labs/modal-client/pull/2797"),
    "a100-80g": (81920, "github.com/modal-labs/modal-client/pull/2797"),
    "h100": (81559, "github.com/modal-labs/modal-client/pull/2797"),
    "h200": (143771, "nvidia-smi tables in public repositories"),
    "4060ti": (16380, "nvidia-smi tables in public repositories (RTX 4060 Ti 16GB)"),
    "5090": (32607, "github.com/noonghunna/club-3090/issues/617"),
    "h20": (97871, "an nvidia-smi table in a public repository's test notes"),
    "l20": (46068, "github.com/vllm-project/vllm/issues/14011"),
}
# NVML device names (nvidia-smi --query-gpu=name) of the shipped cards, held here apart from
# the profiles; GPU feature discovery labels a node nvidia.com/gpu.product with it sanitised.
# Checked against nvidia.com/gpu.product label values in public manifests; none found for the
# 4060 Ti and 5090, whose names follow the GeForce pattern.
NVML_NAMES = {
    "3090": "NVIDIA GeForce RTX 3090", "4060ti": "NVIDIA GeForce RTX 4060 Ti",
    "4090": "NVIDIA GeForce RTX 4090", "4090d": "NVIDIA GeForce RTX 4090 D",
    "5090": "NVIDIA GeForce RTX 5090", "a100-40g": "NVIDIA A100-SXM4-40GB",
    "a100-80g": "NVIDIA A100-SXM4-80GB", "a10g": "NVIDIA A10G", "h100": "NVIDIA H100 80GB HBM3",
    "h20": "NVIDIA H20", "h200": "NVIDIA H200", "l20": "NVIDIA L20", "l4": "NVIDIA L4",
    "l40s": "NVIDIA L40S",
}
GOOD = (Path(__file__).parent.parent / "build_configs" / "4090d.toml").read_text()


def test_every_required_profile_ships_and_loads():
    assert REQUIRED <= set(profile_names())
    for name in profile_names():
        p = load_profile(name)
        assert p.name == name
        lim = p.limits
        assert lim.max_image_tokens <= lim.max_visual_tokens_per_request < lim.max_input_len
        assert lim.max_input_len < lim.max_seq_len


def test_every_profile_has_the_memory_the_driver_reports():
    assert set(DRIVER_MIB) == set(profile_names())  # a new profile needs its driver figure
    for name, (mib, _source) in DRIVER_MIB.items():
        p = load_profile(name)
        assert p.gpu.memory_mib == mib, name
        assert p.memory_bytes == mib * 2**20
        # The comment beside the key names where the figure comes from.
        assert f"memory_mib = {mib}" in Path(p.source).read_text()
        assert "# memory: nvidia-smi memory.total" in Path(p.source).read_text(), name


def test_every_profile_names_the_node_label_of_its_card():
    assert set(NVML_NAMES) == set(profile_names())  # a new profile needs its device name
    for name, device in NVML_NAMES.items():
        product = load_profile(name).gpu.product
        assert product == gpu_product_label(device), name
        assert gpu_product_label(product) == product  # a label value passes unchanged
    # Upstream's sanitise: other characters dropped, runs of blanks joined by one '-'.
    assert gpu_product_label(" NVIDIA  A100 (PCIe)/x ") == "NVIDIA-A100-PCIex"


def test_a_profile_without_a_node_label_loads_and_a_bad_one_is_refused(tmp_path):
    line = 'product = "NVIDIA-GeForce-RTX-4090-D"\n'
    assert line in GOOD
    assert load_profile(_write(tmp_path, GOOD.replace(line, ""))).gpu.product == ""
    bad = GOOD.replace(line, 'product = "NVIDIA GeForce RTX 4090 D"\n')
    with pytest.raises(ConfigError, match="gpu.product 'NVIDIA GeForce RTX 4090 D' is not a "
                       "node label value"):
        load_profile(_write(tmp_path, bad))


def test_new_cards_facts():
    facts = {n: load_profile(n) for n in ("4060ti", "5090", "h20", "l20")}
    assert {n: (p.sm, p.gpu.trt_edition) for n, p in facts.items()} == {
        "4060ti": (89, TrtEdition.TENSORRT_RTX), "5090": (120, TrtEdition.TENSORRT_RTX),
        "h20": (90, TrtEdition.TENSORRT), "l20": (89, TrtEdition.TENSORRT)}
    lim = facts["4060ti"].limits
    # 768-px-class images at batch 1-2.
    assert lim.max_batch_size == 2 and lim.vision_max_pixels == 768 * 768


def test_editions_follow_the_card_class():
    assert load_profile("4090d").gpu.trt_edition is TrtEdition.TENSORRT_RTX
    # TensorRT-RTX refuses compute capability 9.0.
    for name in ("h100", "h200", "h20"):
        p = load_profile(name)
        assert p.sm == 90 and p.gpu.trt_edition is TrtEdition.TENSORRT


def test_a_build_records_profile_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert profile_argument("4090d") == "4090d"
    assert profile_argument("mine.toml") == str(tmp_path / "mine.toml")
    assert profile_argument("profiles/mine") == str(tmp_path / "profiles" / "mine")


def test_a_written_profile_loads_back_equal(tmp_path):
    for name in profile_names():
        profile = load_profile(name)
        path = tmp_path / f"{name}.toml"
        path.write_text(profile_toml(profile, "written back\nsecond line"))
        again = load_profile(str(path))
        assert (again.gpu, again.limits, again.vision_build) == \
            (profile.gpu, profile.limits, profile.vision_build), name
        assert path.read_text().startswith("# written back\n# second line\n")


def test_user_file_by_path(tmp_path):
    path = tmp_path / "my.toml"
    path.write_text(GOOD.replace("max_batch_size = 12", "max_batch_size = 4"))
    p = load_profile(str(path))
    assert p.name == "my" and p.limits.max_batch_size == 4


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max_batch_size = 12\n", "", "missing key 'max_batch_size'"),
        ("max_batch_size = 12", "max_batch_size = 12\nmax_batchsize = 8", "unknown key 'max_batchsize'"),
        ("max_batch_size = 12", 'max_batch_size = "12"', "max_batch_size: expected an integer, got '12'"),
        ("max_batch_size = 12", "max_batch_size = true", "max_batch_size: expected an integer"),
        ("max_batch_size = 12", "max_batch_size = 12.5", "max_batch_size: expected an integer"),
        ('trt_edition = "tensorrt_rtx"', 'trt_edition = "tensorrt-rtx"', "trt_edition: 'tensorrt-rtx' is not one of"),
        ('compute_capability = "8.9"', "compute_capability = 8.9", "compute_capability: expected a string"),
        ('compute_capability = "8.9"', 'compute_capability = "sm89"', 'must look like "8.9"'),
        ("kv_cache_free_gpu_mem_fraction = 0.9", "kv_cache_free_gpu_mem_fraction = 1.5", "between 0 and 1"),
        ("tokens_per_block = 64", "tokens_per_block = 48", "power of two"),
        ("max_seq_len = 16384", "max_seq_len = 14336", "must exceed limits.max_input_len"),
        ("video_max_tokens = 12288", "video_max_tokens = 2047",
         "limits.max_visual_tokens_per_request (12288) exceeds what 2 images at "
         "limits.vision_max_pixels and 1 videos at limits.video_max_tokens can make (6143)"),
        ("max_visual_tokens_per_request = 12288", "max_visual_tokens_per_request = 4095",
         "limits.video_max_tokens (12288) must be positive and at most "
         "limits.max_visual_tokens_per_request (4095)"),
        ("max_videos_per_request = 1", "max_videos_per_request = 0",
         "exceeds what 2 images at limits.vision_max_pixels and 0 videos at "
         "limits.video_max_tokens can make (4096)"),
        ("max_input_len = 14336", "max_input_len = 12288", "(12288) leaves no room for text"),
        ("max_visual_tokens_per_request = 12288\n", "", "missing key 'max_visual_tokens_per_request'"),
        ("max_batch_size = 12", "max_batch_size = 0", "max_batch_size must be positive"),
        ("video_max_tokens = 12288\n", "", "missing key 'video_max_tokens'"),
        ("max_videos_per_request = 1", "max_videos_per_request = -1", "must be 0 (no video) or more"),
        ("video_max_frames = 64", "video_max_frames = 1", "limits.video_max_frames (1) is below one "
         "temporal patch of 2 frames"),
        ("video_max_pixels_per_frame = 2097152", "video_max_pixels_per_frame = 2097153",
         "limits.video_max_pixels_per_frame (2097153) must be positive and at most "
         "limits.vision_max_pixels (2097152)"),
        ("[vision_build]", "[vision]", "unknown key 'vision'"),
        # The marketing figure is no longer a key: memory is what the driver reports.
        ("memory_mib = 24564", "memory_gib = 24", "unknown key 'memory_gib'"),
        ("memory_mib = 24564", "memory_mib = 23.9", "memory_mib: expected an integer"),
        ("memory_mib = 24564", "memory_mib = 0", "gpu.memory_mib must be positive"),
    ],
)
def test_bad_profile_names_the_key(tmp_path, old, new, message):
    assert old in GOOD
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_profile(_write(tmp_path, GOOD.replace(old, new, 1)))
    assert "\n" not in str(err.value)


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="unknown GPU profile 'rtx9999'.*4090d"):
        load_profile("rtx9999")


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(_write(tmp_path, "[gpu\nname="))


def test_compute_capability_has_one_spelling_of_its_digits() -> None:
    from qvl_trt.build.matrix import runner_labels
    from qvl_trt.profiles import sm_digits
    from qvl_trt.vision.engine import _sm

    assert sm_digits("8.9") == "89" and sm_digits("12.0") == "120"
    assert _sm("12.0") == "SM120" and runner_labels("8.6")[-1] == "gpu-sm86"
