"""Request preprocessing speed: qvl_trt vs the Hugging Face processor, same inputs, same run.

Input: a decoded 1920x1080 JPEG and a one-line question. Baseline: what the HF Qwen3-VL
processor does on the PIL backend (image processor from preprocessor_config.json, chat template,
image pad expansion, tokenisation). Ours: `RequestPreprocessor.prepare`, which also computes
the rope index, the MRoPE table, fake ids, extra ids, image hashes and the vision index
tensors. Outputs are checked equal before timing. Prints medians and the ratio.

    python scripts/bench_preprocess.py [--model CKPT] [--gpu 4090] [--repeat 20]

Without --model a tiny checkpoint (real tokenizer and processor config) is written to a
temporary folder.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

QUESTION = "Describe this image in detail."


def photo_like_jpeg(width: int = 1920, height: int = 1080) -> bytes:
    """Smooth gradients plus noise, JPEG-encoded like a camera frame."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """Median wall seconds and mean CPU seconds (all threads) over `repeat` calls after one
    warm-up call, and the last result."""
    result = fn()
    times = []
    cpu_start = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu_start) / repeat, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Qwen3-VL checkpoint folder")
    parser.add_argument("--gpu", default="4090", help="GPU profile for the limits")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    import transformers

    from qvl_trt.mm.chat import user_message
    from qvl_trt.mm.pixels import image_patches
    from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
    from qvl_trt.profiles import load_profile

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

            model = write_tiny_checkpoint(Path(tmp) / "ckpt")
        profile = load_profile(args.gpu)
        ours = RequestPreprocessor.from_checkpoint(model, RequestLimits.from_profile(profile))
        hf_images = transformers.AutoImageProcessor.from_pretrained(
            str(model), backend="pil",
            size={"shortest_edge": ours.pixels.min_pixels, "longest_edge": ours.pixels.max_pixels})
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))

        image = Image.open(io.BytesIO(photo_like_jpeg()))
        image.load()
        messages = user_message(QUESTION, 1)

        def hf() -> tuple[np.ndarray, np.ndarray]:
            out = hf_images(image, return_tensors="np")
            tokens = int(out["image_grid_thw"][0].prod()) // hf_images.merge_size**2
            text = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
            text = text.replace("<|image_pad|>", "<|image_pad|>" * tokens)
            return out["pixel_values"], np.asarray(hf_tokenizer(text)["input_ids"])

        def qvl():
            return ours.prepare(messages=messages, images=[image])

        hf_s, hf_cpu, (hf_pixels, hf_ids) = timed(hf, args.repeat)
        our_s, our_cpu, request = timed(qvl, args.repeat)
        hf_pix_s, _, _ = timed(lambda: hf_images(image, return_tensors="np"), args.repeat)
        our_pix_s, _, _ = timed(lambda: image_patches(image, ours.pixels), args.repeat)

    # Ours are the 8-bit values; the vision graph makes HF's floats of them with this table.
    pixels = ours.pixels.normalise(request.pixel_values)
    diff = float(np.abs(pixels - hf_pixels).max())
    if pixels.shape != hf_pixels.shape or diff > 1e-6 or not np.array_equal(
            request.input_ids, hf_ids):
        raise SystemExit(f"outputs differ (pixel max abs diff {diff}); not timing unequal work")
    print(f"input: decoded {image.width}x{image.height} JPEG -> {pixels.shape[0]} patches, "
          f"{request.num_tokens} prompt tokens; profile {profile.name}; median of "
          f"{args.repeat} runs; pixel max abs diff {diff:g}")
    print(f"HF processor (PIL)      : {hf_s * 1e3:7.1f} ms wall, {hf_cpu * 1e3:7.1f} ms CPU "
          f"(image processor alone {hf_pix_s * 1e3:.1f} ms)")
    print(f"qvl_trt prepare (all)   : {our_s * 1e3:7.1f} ms wall, {our_cpu * 1e3:7.1f} ms CPU "
          f"(pixels alone {our_pix_s * 1e3:.1f} ms; {os.cpu_count()} CPUs)")
    print(f"speed-up: {hf_s / our_s:.2f}x wall for the whole request ({hf_cpu / our_cpu:.2f}x "
          f"in CPU time), {hf_pix_s / our_pix_s:.2f}x wall for the pixels")


if __name__ == "__main__":
    main()
