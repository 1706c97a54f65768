"""transformers' Qwen3-VL processor on the video test clips, in an interpreter where torchvision
imports (qvl_trt/testing/torchvision_env.py); tests/test_mm_video_hf.py compares its output
with ours.

    PY tests/hf_video_processor.py SITE OUT.npz < SPEC.json

SITE: the caller's site-packages (torchvision_env.CALLER_SITE), added after PY's own, where
transformers, numpy and Pillow come from.

SPEC: {"checkpoint", "messages", "fps", "clips": [[frames, width, height], ...]}. The clips'
frames are made here as the tests make them (video_clips.frame_pixels). OUT holds, per clip i:
ids_i, grid_i, levels_i (the pixel rows as 8-bit levels: x / 127.5 - 1 undone, rounded) and
off_i (the largest distance of a level from the integer it was rounded to: the processor
normalises uint8 pixels, so ~0), and `transformers`, its version.
"""

from __future__ import annotations

import json
import site
import sys


def main(out: str) -> None:
    import numpy as np
    import transformers
    from video_clips import frame_pixels

    spec = json.load(sys.stdin)
    processor = transformers.AutoProcessor.from_pretrained(spec["checkpoint"])
    text = processor.apply_chat_template(spec["messages"], tokenize=False,
                                         add_generation_prompt=True)
    fps = spec["fps"]
    results = {"transformers": np.array(transformers.__version__)}
    for i, (frames, width, height) in enumerate(spec["clips"]):
        clip = np.stack([frame_pixels(f, width, height) for f in range(frames)])
        # The reference's per-frame pixel cap (qwen-vl-utils), which transformers applies only
        # when asked (its default stays uncapped, with a warning, through 5.25).
        hf = processor(text=[text], videos=[clip], do_sample_frames=False, return_tensors="np",
                       cap_pixels_per_frame=True,
                       video_metadata=[{"fps": fps, "total_num_frames": frames,
                                        "frames_indices": list(range(frames))}])
        levels = (hf["pixel_values_videos"].astype(np.float64) + 1) * 127.5
        rounded = np.rint(levels)
        results[f"ids_{i}"] = hf["input_ids"][0]
        results[f"grid_{i}"] = hf["video_grid_thw"]
        results[f"levels_{i}"] = np.clip(rounded, 0, 255).astype(np.uint8)
        results[f"off_{i}"] = np.array(np.abs(levels - rounded).max())
    np.savez(out, **results)


if __name__ == "__main__":
    site.addsitedir(sys.argv[1])
    main(sys.argv[2])
