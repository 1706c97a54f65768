"""Host cost of a video request, from the bytes a client sends: the Triton preprocessing
model's function on an MP4, with the frame resize we ship (torchvision's uint8 bicubic taps in
the compiled passes, mm/taps.py: exact to transformers' video processor) against the same
request with PIL's bicubic resize in its place (up to 2 levels off), interleaved.

The clip is a typical one by default: 10 s of 1280x720 at 30 fps (H.264, made with
PyAV), sampled at 3 fps = 30 frames. Each repeat runs both sides in a rotating order after
--warmup untimed calls; also timed alone: decoding and sampling the file. Prints medians and
the ratio (exact / PIL).

    python scripts/bench_video_preprocess.py [--size 1280x720] [--seconds 10] [--fps 3]
        [--repeat 5] [--warmup 1]

Without --model a tiny checkpoint (the released checkpoints' processor configs) is written to
a temporary folder; the text side is the same for every model.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_clip(width: int, height: int, seconds: int, rate: int = 30) -> bytes:
    import av

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    ramps = (x[..., None] * [0.2, 0.05, 0.1] + y[..., None] * [0.05, 0.3, 0.1]).astype(np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=rate, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * rate):
            moved = ramps + np.uint8(3 * i % 256)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(moved, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def pil_resize(frames, height, width):
    """resize_frames' contract (each frame's channel planes) with PIL's resize."""
    from PIL import Image

    resized = (f.resize((width, height), Image.Resampling.BICUBIC) for f in frames)
    return [[np.asarray(band) for band in image.split()] for image in resized]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--fps", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    import qvl_trt.mm.video as video
    from qvl_trt.client.generate import GenerateRequest, ensemble_request
    from qvl_trt.mm.video_decode import Sampling, decode_video
    from qvl_trt.profiles import load_profile
    from qvl_trt.triton.contract import PREPROCESSING_INPUTS
    from qvl_trt.triton.repository import RepoOptions, preprocessing_parameters
    from qvl_trt.triton.runtime.backend import row_of
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

            model = write_tiny_checkpoint(Path(tmp) / "ckpt")
        # A profile's limits, widened to admit the clip whatever the profile's size.
        params = dataclasses.replace(
            preprocessing_parameters(load_profile("h100"), RepoOptions()),
            max_input_len=16384, max_seq_len=16384, max_visual_tokens=16384)
        step = Preprocessor(model, params)
        clip = make_clip(width, height, args.seconds)
        row = row_of({name: _Tensor(value) for name, value in ensemble_request(
            GenerateRequest("Describe the video.", videos=(clip,), video_fps=args.fps)
        ).to_tensors().items()}, PREPROCESSING_INPUTS)
        exact_resize = video.resize_frames

        def run(side: str) -> float:
            video.resize_frames = exact_resize if side == "exact" else pil_resize
            start = time.perf_counter()
            out = step(row)
            elapsed = time.perf_counter() - start
            assert out["pixel_values"].shape[0] > 0
            return elapsed

        sampling = Sampling(fps=args.fps, min_frames=4, max_frames=768, max_seconds=3600,
                            max_decoded_pixels=2**30)
        times: dict[str, list[float]] = {"exact": [], "pil": [], "decode": []}
        sides = ["exact", "pil"]
        for n in range(args.warmup + args.repeat):
            for side in sides[n % 2:] + sides[:n % 2]:
                elapsed = run(side)
                if n >= args.warmup:
                    times[side].append(elapsed)
            start = time.perf_counter()
            frames = decode_video(clip, sampling).frames
            if n >= args.warmup:
                times["decode"].append(time.perf_counter() - start)
        video.resize_frames = exact_resize
    median = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"{len(frames)} frames of {width}x{height} from a {len(clip) / 2**20:.1f} MiB MP4 "
          f"({args.seconds} s at 30 fps, sampled at {args.fps:g} fps), {os.cpu_count()} CPUs")
    print(f"preprocessing, exact resize: {median['exact']:.0f} ms; with PIL's resize: "
          f"{median['pil']:.0f} ms; ratio exact / PIL {median['exact'] / median['pil']:.2f}")
    print(f"of which decoding and sampling the file: {median['decode']:.0f} ms")


class _Tensor:
    """What row_of reads of a Triton tensor: as_numpy()."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return self.value


if __name__ == "__main__":
    main()
