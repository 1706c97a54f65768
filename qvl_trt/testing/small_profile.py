"""GPU profile files with small limits, for the tests that build and serve the tiny
checkpoint (shipped profiles would size tables and caches for real models)."""

from __future__ import annotations

LIMITS = {
    "max_batch_size": 8,
    "max_input_len": 768,
    "max_seq_len": 1024,
    "max_num_tokens": 1024,
    "tokens_per_block": 32,
    "kv_cache_free_gpu_mem_fraction": 0.9,
    "vision_min_pixels": 4096,
    "vision_max_pixels": 65536,
    "max_images_per_request": 2,
    "max_visual_tokens_per_request": 128,  # both images at vision_max_pixels
    "max_videos_per_request": 2,
    "video_max_frames": 16,
    "video_max_pixels_per_frame": 65536,
    "video_max_tokens": 128,
}


def small_profile_toml(*, compute_capability: str = "8.9", trt_edition: str = "tensorrt_rtx",
                       **limits: float) -> str:
    """Profile text: test-GPU facts, LIMITS with `limits` overriding, the fastest builder."""
    unknown = set(limits) - set(LIMITS)
    assert not unknown, f"not a limit: {unknown}"
    values = {**LIMITS, **limits}
    lines = ["[gpu]", 'description = "test GPU, small limits"',
             f'compute_capability = "{compute_capability}"', "memory_mib = 24564",
             "memory_bandwidth_gbs = 1000", "fp16_tensor_tflops = 100.0",
             f'trt_edition = "{trt_edition}"', "", "[limits]"]
    lines += [f"{key} = {value}" for key, value in values.items()]
    lines += ["", "[vision_build]", "builder_optimization_level = 0", "workspace_gib = 1", ""]
    return "\n".join(lines)
