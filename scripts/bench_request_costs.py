"""What a heavy request costs the preprocessing step before it is answered: for each case, the
time to the answer (the tensors, or the one-line refusal) and the peak RSS the step reaches,
each case in a fresh worker process so one case's memory does not hide another's.

Cases (built as a client sends them, `ensemble_request` -> `row_of`, as
triton_repo/preprocessing/1/model.py calls `Preprocessor`):
- jpeg_1080p: a 1920x1080 photo-like JPEG and a one-line question, the baseline;
- prompt_1mib: a text_input of 1 MiB (the max_text_bytes bound), far above max_input_len;
- png_8000_rgba: an 8000x8000 RGBA PNG of a few hundred KB (inside the 8192^2 decode bound);
- mp4_8k_4frames: a 4-frame 7680x4320 H.264 MP4.
Per case: the median time over --repeat calls, the outcome (ok, or the refusal's first
words), the peak RSS above the worker's RSS before the call (VmHWM, reset before the first
call through /proc/self/clear_refs), and the RSS left after the call; then each time and peak
as a ratio to the baseline's.

    python scripts/bench_request_costs.py [--model CKPT] [--gpu 4090] [--repeat 3]

Without --model a tiny checkpoint (the real tokenizer and processor configs) is written to a
temporary folder; the limits are the --gpu profile's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

QUESTION = "Describe this in one word."
CASES = ("jpeg_1080p", "prompt_1mib", "png_8000_rgba", "mp4_8k_4frames")
BASELINE = CASES[0]


def make_case(name: str, folder: Path) -> Path:
    """The case's input file (the prompt's text, or the encoded image or video)."""
    from bench_preprocess import photo_like
    from bench_video_preprocess import make_clip

    path = folder / name
    if name == "jpeg_1080p":
        path.write_bytes(photo_like(1920, 1080, "jpeg"))
    elif name == "prompt_1mib":
        words = "the quick brown fox jumps over the lazy dog "
        path.write_text((words * (2**20 // len(words) + 1))[:2**20])
    elif name == "png_8000_rgba":
        # Flat areas and a few edges: compresses to a few hundred KB, decodes to 256 MB.
        pixels = np.zeros((8000, 8000, 4), np.uint8)
        pixels[:, :, 3] = 255
        pixels[1000:7000, 1000:7000] = (200, 40, 40, 128)
        pixels[::400, :, :3] = 255
        buffer = io.BytesIO()
        Image.fromarray(pixels, "RGBA").save(buffer, format="PNG")
        path.write_bytes(buffer.getvalue())
    else:
        path.write_bytes(make_clip(7680, 4320, 1, rate=4))
    return path


def rss_kib(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(model: str, gpu: str, case: str, path: Path, repeat: int) -> None:
    from qvl_trt.client.generate import GenerateRequest, ensemble_request
    from qvl_trt.errors import InputError
    from qvl_trt.profiles import load_profile
    from qvl_trt.triton import contract as c
    from qvl_trt.triton.repository import RepoOptions, preprocessing_parameters
    from qvl_trt.triton.runtime.backend import row_of
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    class Tensor:  # what pb_utils.get_input_tensor_by_name gives the model
        def __init__(self, value: np.ndarray) -> None:
            self.value = value

        def as_numpy(self) -> np.ndarray:
            return self.value

    step = Preprocessor(Path(model), preprocessing_parameters(load_profile(gpu), RepoOptions()))
    data = path.read_bytes()
    if case == "prompt_1mib":
        request = GenerateRequest(data.decode())
    elif case == "mp4_8k_4frames":
        request = GenerateRequest(QUESTION, videos=(data,))
    else:
        request = GenerateRequest(QUESTION, images=(data,))
    fields = ensemble_request(request).to_tensors()
    inputs = {name: Tensor(value) for name, value in fields.items()}
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    seconds, outcome = [], "ok"
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            step(row_of(inputs, c.PREPROCESSING_INPUTS))
        except InputError as exc:
            outcome = f"refused: {' '.join(str(exc).split()[:9])} ..."
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(seconds), "outcome": outcome,
                      "peak_mib": (rss_kib("VmHWM") - before) / 1024,
                      "left_mib": (rss_kib("VmRSS") - before) / 1024}))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, gpu, case, path, repeat = sys.argv[2:7]
        worker(model, gpu, case, Path(path), int(repeat))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="Qwen3-VL checkpoint folder")
    parser.add_argument("--gpu", default="4090", help="GPU profile for the limits")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    args = parser.parse_args()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    with tempfile.TemporaryDirectory(prefix="qvl-bench-costs-") as tmp:
        model = args.model
        if model is None:
            from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

            model = write_tiny_checkpoint(Path(tmp) / "ckpt")
        results = {}
        for case in args.cases.split(","):
            path = make_case(case, Path(tmp))
            out = subprocess.run(
                [sys.executable, __file__, "--worker", str(model), args.gpu, case, str(path),
                 str(args.repeat)], capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"{case}: the worker failed:\n{out.stderr[-2000:]}")
            results[case] = json.loads(out.stdout.strip().splitlines()[-1])
            results[case]["input_kib"] = path.stat().st_size / 1024
    print(f"revision {revision}; {args.gpu} limits; median of {args.repeat} calls per case, "
          "each case in a fresh process; peak and left: RSS above the process's before the "
          "first call")
    base = results.get(BASELINE)
    print(f"{'case':<16} {'input':>9} {'time':>9} {'peak':>10} {'left':>9} "
          f"{'time/base':>9} {'peak/base':>9}  outcome")
    for case, r in results.items():
        ratios = (f"{r['seconds'] / base['seconds']:9.1f} "
                  f"{r['peak_mib'] / max(base['peak_mib'], 1):9.1f}") if base else " " * 19
        print(f"{case:<16} {r['input_kib']:7.0f}KB {r['seconds'] * 1e3:7.0f}ms "
              f"{r['peak_mib']:7.0f}MiB {r['left_mib']:6.0f}MiB {ratios}  {r['outcome']}")


if __name__ == "__main__":
    main()
