"""Request preprocessing speed from encoded bytes: the Triton preprocessing model's function
against the Hugging Face Qwen3-VL processors, interleaved in one run.

Inputs are built as a client sends them (`qvl_trt.client.generate.ensemble_request`: a one-line
question as text_input, one JPEG or PNG file as image_bytes) at each --sizes entry. Timed, per
call, from those bytes:
- ours: `Preprocessor.__call__` on `row_of(...)` of the request's tensors, as
  triton_repo/preprocessing/1/model.py's execute calls it (decode, resize, 8-bit patches,
  hashes, chat template, tokens, rope index, MRoPE table, stop words, settings);
- pil: transformers' image processor with backend="pil" on PIL.Image.open(BytesIO(bytes)),
  the chat template, image pad expansion and tokenisation;
- torchvision: the same with backend="torchvision" (the "fast" processor transformers picks by
  default), run in a worker process under --torchvision-python;
- decode: `load_rgb` alone (decode to RGB, on one thread as Pillow does), the floor that every
  side pays before any resizing.
Each repeat runs every case and, within a case, the sides in a rotating order; --warmup
untimed calls per side and case come first. Prints medians, ratios (their time / ours), the
max abs difference of our pixels (through `PixelConfig.normalise`, what the vision graph makes
of our uint8 rows) from theirs, and whether grids and token ids are equal.

    python scripts/bench_preprocess.py [--model CKPT] [--gpu 4090] [--sizes 1920x1080,...]
        [--formats jpeg,png] [--repeat 5] [--warmup 1] [--torchvision-python PY]
        [--profile 1920x1080]

The torchvision column needs an interpreter where torch and torchvision import together and
transformers and numpy import too (default: this one; otherwise the column prints "skipped").
On a machine with a CPU-only torch and no matching torchvision, a throwaway venv outside the
repository that reuses this environment for everything but torch works:

    python -m venv ../tv && echo "$VIRTUAL_ENV/lib/python3.11/site-packages" \\
        > ../tv/lib/python3.11/site-packages/main-venv.pth
    ../tv/bin/pip install torch==2.14.1 torchvision==0.29.1   # the PyPI pair (CUDA wheels)
    python scripts/bench_preprocess.py --torchvision-python ../tv/bin/python

(the venv's own torch comes before the .pth path). A GPU machine with torch + torchvision
installed needs no flag. --profile WxH prints a cProfile of our function on that JPEG.
Without --model a tiny checkpoint (real tokenizer and processor config) is written to a
temporary folder.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
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

QUESTION = "Describe this image in detail."
SIDES = ("ours", "pil", "torchvision", "decode")
FORMATS = {"jpeg": {"format": "JPEG", "quality": 90}, "png": {"format": "PNG"}}


def photo_like(width: int, height: int, fmt: str) -> bytes:
    """Smooth gradients plus noise, encoded like a camera frame or a screenshot file."""
    rng = np.random.default_rng(width * height)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, **FORMATS[fmt])
    return buffer.getvalue()


class HfSide:
    """One Hugging Face processor (image processor + tokenizer) on one request's bytes."""

    def __init__(self, model: str, backend: str, min_pixels: int, max_pixels: int) -> None:
        import transformers

        from qvl_trt.chat_messages import user_message

        self.images = transformers.AutoImageProcessor.from_pretrained(
            model, backend=backend,
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
        # transformers falls back to the other backend with a warning: refuse that here.
        if (type(self.images).__name__.endswith("Pil")) != (backend == "pil"):
            raise RuntimeError(f"transformers gave {type(self.images).__name__} for "
                               f"backend={backend}")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        self.tensors = "np" if backend == "pil" else "pt"
        self.messages = user_message(QUESTION, 1)

    def __call__(self, data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pixel_values float32, image_grid_thw, input_ids)."""
        out = self.images(Image.open(io.BytesIO(data)), return_tensors=self.tensors)
        grid = np.asarray(out["image_grid_thw"])
        tokens = int(grid[0].prod()) // self.images.merge_size**2
        text = self.tokenizer.apply_chat_template(self.messages, tokenize=False,
                                                  add_generation_prompt=True)
        text = text.replace("<|image_pad|>", "<|image_pad|>" * tokens)
        return (out["pixel_values"], grid, np.asarray(self.tokenizer(text)["input_ids"]))


def worker(model: str, cases_dir: Path, min_pixels: int, max_pixels: int) -> None:
    """The torchvision side in its own interpreter: answers 'i' with the seconds of one call
    on case i, and 'dump' by saving each case's last outputs as cases_dir/i.npz."""
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401

        side = HfSide(model, "torchvision", min_pixels, max_pixels)
    except Exception as exc:  # reported, not raised: the other columns still run
        print(f"skipped: torchvision does not import here ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})", flush=True)
        return
    print(f"ready torch {torch.__version__} torchvision {torchvision.__version__} "
          f"({torch.get_num_threads()} threads)", flush=True)
    cases = sorted(cases_dir.glob("*.bin"), key=lambda p: int(p.stem))
    data = [p.read_bytes() for p in cases]
    last: dict[int, tuple] = {}
    for line in sys.stdin:
        if line.strip() == "dump":
            for i, (pixels, grid, ids) in last.items():
                np.savez(cases_dir / f"{i}.npz", pixels=np.asarray(pixels, np.float32),
                         grid=grid, ids=ids)
            print("ok", flush=True)
            return
        i = int(line)
        start = time.perf_counter()
        last[i] = side(data[i])
        print(time.perf_counter() - start, flush=True)


class TorchvisionWorker:
    def __init__(self, python: str, model: Path, cases_dir: Path, min_pixels: int,
                 max_pixels: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", str(model), str(cases_dir), str(min_pixels),
             str(max_pixels)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env)
        self.status = self.proc.stdout.readline().strip() or \
            "skipped: torchvision does not import here (the worker exited)"
        self.ready = self.status.startswith("ready")
        self.cases_dir = cases_dir

    def __call__(self, i: int) -> float:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        seconds = float(self.proc.stdout.readline())
        self._settle()
        return seconds

    def _settle(self, quiet_ns: int = 200_000, step_s: float = 0.002, limit_s: float = 0.2) \
            -> None:
        """Wait until the worker stops using CPU: after a call torch's OpenMP threads
        spin-wait for a while (7-9 ms of CPU after each call was seen), which would be
        counted against the next side timed. Its own time is measured inside it, unchanged."""
        tasks = Path(f"/proc/{self.proc.pid}/task")

        def cpu_ns() -> int:
            total = 0
            for task in tasks.iterdir():
                try:
                    total += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    pass  # a thread that has just ended
            return total

        deadline = time.perf_counter() + limit_s
        before = cpu_ns()
        while time.perf_counter() < deadline:
            time.sleep(step_s)
            now = cpu_ns()
            if now - before < quiet_ns:
                return
            before = now

    def outputs(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with np.load(self.cases_dir / f"{i}.npz") as f:
            return f["pixels"], f["grid"], f["ids"]

    def close(self) -> None:
        if self.ready:
            self.proc.stdin.write("dump\n")
            self.proc.stdin.flush()
            self.proc.stdout.readline()
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Tensor:
    """What pb_utils.get_input_tensor_by_name gives the model: as_numpy()."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return self.value


def compare(ours: dict, theirs: tuple, step) -> tuple[str, str]:
    """(max abs pixel difference, 'yes'/'no' for grid and ids equal) of ours against theirs."""
    from qvl_trt.triton import contract as c

    pixels, grid, ids = (np.asarray(v) for v in theirs)
    ckpt = step.requests.checkpoint
    engine_ids = ours[c.INPUT_IDS]
    # Our prompt carries fake ids (>= vocab size) where theirs has the image pad token.
    real_ids = np.where(engine_ids >= ckpt.text.vocab_size, ckpt.token_ids.image, engine_ids)
    same = np.array_equal(ours[c.IMAGE_GRID_THW], grid) and np.array_equal(real_ids, ids)
    ours_pixels = step.requests.pixels.normalise(ours[c.PIXEL_VALUES])
    if ours_pixels.shape != pixels.shape:
        return f"shape {pixels.shape}", "no"
    return f"{float(np.abs(ours_pixels - pixels).max()):.3g}", "yes" if same else "no"


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, cases, lo, hi = sys.argv[2:6]
        worker(model, Path(cases), int(lo), int(hi))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Qwen3-VL checkpoint folder")
    parser.add_argument("--gpu", default="4090", help="GPU profile for the limits")
    parser.add_argument("--sizes", default="640x480,1280x720,1920x1080,3840x2160")
    parser.add_argument("--formats", default="jpeg,png")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per side and case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    parser.add_argument("--torchvision-python", default=sys.executable,
                        help="interpreter where torch + torchvision import (see above)")
    parser.add_argument("--profile", metavar="WxH", help="cProfile our function on this JPEG")
    args = parser.parse_args()

    from qvl_trt.client.generate import GenerateRequest, ensemble_request
    from qvl_trt.mm.image_input import load_rgb
    from qvl_trt.profiles import load_profile
    from qvl_trt.triton import contract as c
    from qvl_trt.triton.repository import RepoOptions, preprocessing_parameters
    from qvl_trt.triton.runtime.backend import row_of
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    cases = [(w, h, fmt, photo_like(w, h, fmt)) for w, h in sizes
             for fmt in args.formats.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

            model = write_tiny_checkpoint(Path(tmp) / "ckpt")
        profile = load_profile(args.gpu)
        step = Preprocessor(model, preprocessing_parameters(profile, RepoOptions()))
        bounds = (step.requests.pixels.min_pixels, step.requests.pixels.max_pixels)
        pil = HfSide(str(model), "pil", *bounds)
        cases_dir = Path(tmp) / "cases"
        cases_dir.mkdir()
        for i, (*_, data) in enumerate(cases):
            (cases_dir / f"{i}.bin").write_bytes(data)
        tv = TorchvisionWorker(args.torchvision_python, model, cases_dir, *bounds)

        requests = []
        for *_, data in cases:
            fields = ensemble_request(GenerateRequest(QUESTION, images=(data,))).to_tensors()
            requests.append({name: Tensor(value) for name, value in fields.items()})

        def ours(i: int):
            return step(row_of(requests[i], c.PREPROCESSING_INPUTS))

        def timed(fn, i: int) -> float:
            start = time.perf_counter()
            fn(i)
            return time.perf_counter() - start

        calls = {"ours": lambda i: timed(ours, i),
                 "pil": lambda i: timed(lambda j: pil(cases[j][3]), i),
                 "decode": lambda i: timed(lambda j: load_rgb(cases[j][3]), i)}
        if tv.ready:
            calls["torchvision"] = tv
        sides = [s for s in SIDES if s in calls]
        times = {(s, i): [] for s in sides for i in range(len(cases))}
        try:
            for r in range(args.warmup + args.repeat):
                for i in range(len(cases)):
                    for k in range(len(sides)):
                        side = sides[(r + i + k) % len(sides)]
                        seconds = calls[side](i)
                        if r >= args.warmup:
                            times[side, i].append(seconds)
        finally:
            tv.close()
        print(f"profile {profile.name}, pixels {bounds[0]}..{bounds[1]}; {os.cpu_count()} CPUs; "
              f"median of {args.repeat} interleaved calls after {args.warmup} warm-up; "
              f"torchvision: {tv.status}")
        head = (f"{'input':>15} {'KiB':>6} {'patches':>7} {'ours ms':>8} {'pil ms':>8} "
                f"{'tv ms':>8} {'decode ms':>9} {'pil/ours':>8} {'tv/ours':>7}  {'diff pil':>8} "
                f"{'ids pil':>7} {'diff tv':>8} {'ids tv':>6}")
        print(head)
        for i, (w, h, fmt, data) in enumerate(cases):
            out = ours(i)
            med = {s: statistics.median(times[s, i]) * 1e3 for s in sides}
            pil_diff, pil_same = compare(out, pil(data), step)
            if tv.ready:
                tv_diff, tv_same = compare(out, tv.outputs(i), step)
                tv_cols = f"{med['torchvision']:8.1f}", f"{med['torchvision'] / med['ours']:6.2f}x"
            else:
                tv_diff, tv_same, tv_cols = "-", "-", ("skipped", "-")
            print(f"{f'{w}x{h} {fmt}':>15} {len(data) / 1024:6.0f} "
                  f"{out[c.PIXEL_VALUES].shape[0]:7d} {med['ours']:8.1f} {med['pil']:8.1f} "
                  f"{tv_cols[0]:>8} {med['decode']:9.1f} {med['pil'] / med['ours']:7.2f}x "
                  f"{tv_cols[1]:>7}  "
                  f"{pil_diff:>8} {pil_same:>7} {tv_diff:>8} {tv_same:>6}")
        if args.profile:
            w, h = (int(v) for v in args.profile.split("x"))
            fields = ensemble_request(GenerateRequest(
                QUESTION, images=(photo_like(w, h, "jpeg"),))).to_tensors()
            request = {name: Tensor(value) for name, value in fields.items()}
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(max(args.repeat, 1)):
                step(row_of(request, c.PREPROCESSING_INPUTS))
            profiler.disable()
            print(f"\ncProfile of ours, {w}x{h} JPEG, {max(args.repeat, 1)} calls (tottime):")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
