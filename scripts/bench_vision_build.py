"""The vision build stage at the real Qwen3-VL-2B vision dimensions, as `qvl-trt build
--only vision` runs it: wall time per phase (ONNX export, validation against the Hugging
Face tower, TensorRT engine build) and the peak memory of the whole process tree.

    python scripts/bench_vision_build.py [--gpu 4090d] [--keep DIR]

The checkpoint is the released 2B config with random bf16 vision weights; the language
model's tensors are present with their shapes (the build refuses a checkpoint without them)
but as zeros in a sparse file, which the vision stage never reads. The build runs in a child
process (`run_build(only=(Stage.VISION,))`), the export with its validation and the engine
build each in their own child of it: this script polls /proc for the summed RSS of that whole
tree (a shared page counts once per process, so the figure is an upper bound). Other work on
the machine skews wall times: CPU times and the load average before and after are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

POLL_S = 0.05


def write_2b_checkpoint(out: Path) -> Path:
    """The released 2B config files, random bf16 vision weights, zero LLM weights."""
    import torch
    from safetensors.torch import save_file

    from qvl_trt.checkpoint import VISION_PREFIX, open_checkpoint
    from qvl_trt.testing.tiny_checkpoint import write_config_only

    write_config_only(out, "2b")
    expected = open_checkpoint(out).expected
    generator = torch.Generator().manual_seed(0)
    vision = {}
    for name, shape in expected.items():
        if name.startswith(VISION_PREFIX):
            noise = torch.randn(shape, generator=generator)
            value = 1.0 + 0.1 * noise if len(shape) == 1 and "norm" in name else 0.02 * noise
            vision[name] = value.to(torch.bfloat16)
    save_file(vision, out / "model-00001-of-00002.safetensors", {"format": "pt"})
    _write_sparse_zeros(out / "model-00002-of-00002.safetensors",
                        {n: s for n, s in expected.items() if not n.startswith(VISION_PREFIX)})
    return out


def _write_sparse_zeros(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file of bf16 zeros: the header, then a hole as long as the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(shapes.items()):
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)


def _tree_rss_bytes(root: int) -> int:
    """Summed RSS of `root` and its descendants (0 once it is gone)."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pending.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def step_build(ckpt: str, out: str, gpu: str) -> None:
    """The child: the build as the CLI runs it, restricted to the vision stage."""
    from qvl_trt.build.runner import run_build
    from qvl_trt.manifest import BuildOptions, Stage

    result = run_build(BuildOptions(model=ckpt, gpu=gpu), Path(out), only=(Stage.VISION,))
    stages = {r.stage.value: {"seconds": r.seconds, "summary": r.summary}
              for r in result.stages}
    print(json.dumps(stages))


def measure(ckpt: Path, out: Path, gpu: str) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "_build", str(ckpt), str(out), gpu],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_bytes(proc.pid))
            time.sleep(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stdout, stderr = proc.communicate()
    done.set()
    poller.join()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"the build failed:\n{stderr[-3000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "tree_peak_bytes": peak,
            "largest_process_bytes": usage.ru_maxrss * 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "stages": json.loads(stdout.strip().splitlines()[-1])}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        step_build(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="4090d", help="GPU profile")
    parser.add_argument("--keep", type=Path, help="keep the checkpoint and build folder here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-vision-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f} on {os.cpu_count()} cores")
    ckpt = write_2b_checkpoint(root / "ckpt-2b")
    r = measure(ckpt, root / "build", args.gpu)
    vision = r["stages"]["vision"]
    summary, phases = vision["summary"], vision["summary"]["seconds"]
    print(f"Qwen3-VL-2B vision tower (random bf16 weights) -> {summary['dtype']}, profile "
          f"{args.gpu}, {summary['edition']} {summary['trt_version']}, patches "
          f"{summary['patches']['min']}..{summary['patches']['max']}, engine "
          f"{summary['engine_mib']:.0f} MiB")
    print(f"vision stage {vision['seconds']:.1f} s: export {phases['export']:.1f} s, "
          f"validation {phases['validate']:.1f} s, engine {phases['engine']:.1f} s")
    others = ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in r["stages"].items()
                       if k != "vision")
    print(f"whole run {r['wall_s']:.1f} s wall ({others}; checkpoint open and hashing "
          f"included), {r['cpu_s']:.1f} s CPU")
    print(f"peak memory: process tree {r['tree_peak_bytes'] / 2**30:.2f} GiB (summed RSS, "
          f"polled every {POLL_S * 1000:.0f} ms), largest single process "
          f"{r['largest_process_bytes'] / 2**30:.2f} GiB")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
