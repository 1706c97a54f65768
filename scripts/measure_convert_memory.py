"""Peak memory of `qvl-trt convert` on a full-size checkpoint with random weights.

Writes the released config of Qwen3-VL-8B (or 2B/4B) with random bf16 safetensors shards of
the real shapes (at most 5 GB each, like the released files) into a temporary folder,
converts it to fp16 with each `--weights` mode in turn (a child process each, the output
removed before the next), and prints each child's peak RSS against the largest shard and
against the fp16 conversion's (the baseline, measured first in the same run). The conversion
streams, so the ratio to the largest shard must stay below 2, and weight-only quantization
must not raise the peak above fp16's (ratio <= 1.05: the allocator's noise).

python scripts/measure_convert_memory.py [--variant 8b] [--weights none,int8,int4]
                                         [--tmp-dir DIR] [--tp-size N]

Disk: about 2x the model in bf16 (8B: ~35 GB), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.llm.safetensors_stream import SafetensorsStream
from qvl_trt.testing.tiny_checkpoint import write_config_only

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
BLOCK = 1 << 24  # random values drawn once and tiled: drawing 8.7 G normals takes minutes

# Prints its own peak RSS (kB on Linux) last: RUSAGE_CHILDREN would keep the largest of
# every child so far.
CHILD = """
import resource, sys
from qvl_trt.llm.convert import convert_checkpoint
convert_checkpoint(sys.argv[1], sys.argv[2], max_seq_len=8192, dtype="float16",
                   tp_size=int(sys.argv[3]), weights=sys.argv[4])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
NOISE = 1.05  # peak over fp16's peak still counted as "not above"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="8b", choices=("2b", "4b", "8b"))
    parser.add_argument("--tmp-dir", type=Path, default=None)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--weights", default="none,int8,int4",
                        help="comma-separated modes; none (fp16) first is the baseline")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.weights.split(",") if m.strip()]

    with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix="qvl-convert-mem-") as tmp:
        src = write_config_only(Path(tmp) / "hf", args.variant)
        shapes = open_checkpoint(src).expected
        need = 2.05 * sum(_numel(s) for s in shapes.values()) * 2
        free = shutil.disk_usage(tmp).free
        if free < need:
            print(f"needs {need / 1e9:.1f} GB free in {tmp}, has {free / 1e9:.1f} GB; "
                  "pass --tmp-dir on a larger disk", file=sys.stderr)
            return 2
        started = time.perf_counter()
        shards = write_random_shards(src, shapes)
        print(f"wrote {len(shards)} random bf16 shards in {time.perf_counter() - started:.0f} s: "
              + ", ".join(f"{b / 2**30:.2f}" for b in shards) + " GiB")

        largest = max(shards)
        baseline = None
        ok = True
        for mode in modes:
            out = Path(tmp) / f"trtllm-{mode}"
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out),
                                   str(args.tp_size), mode], check=True, capture_output=True,
                                  text=True)
            seconds = time.perf_counter() - started
            peak = int(done.stdout.split()[-1]) * 1024
            written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            shutil.rmtree(out)
            baseline = baseline or (peak if mode == "none" else None)
            result = {"variant": args.variant, "weights": mode, "tp_size": args.tp_size,
                      "convert_seconds": round(seconds, 1), "peak_rss_gib": round(peak / 2**30, 3),
                      "largest_shard_gib": round(largest / 2**30, 3),
                      "written_gib": round(written / 2**30, 3),
                      "peak_over_largest_shard": round(peak / largest, 3),
                      "peak_over_fp16": round(peak / baseline, 3) if baseline else None}
            print(json.dumps(result), flush=True)
            fits = peak < 2 * largest and (baseline is None or peak <= NOISE * baseline)
            ok = ok and fits
            versus = f", {peak / baseline:.2f} x fp16's" if baseline else ""
            print(f"{mode}: peak RSS {peak / 2**30:.2f} GiB = {peak / largest:.2f} x the largest "
                  f"shard ({largest / 2**30:.2f} GiB){versus}, wrote {written / 2**30:.2f} GiB "
                  f"in {seconds:.0f} s: {'PASS' if fits else 'FAIL'}", flush=True)
    return 0 if ok else 1


def write_random_shards(root: Path, shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Random bf16 tensors of these shapes in <= SHARD_BYTES files plus the index json."""
    block = torch.randn(BLOCK, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = _numel(shapes[name]) * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, sizes = {}, []
    for index, names in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        with SafetensorsStream(root / file, "bfloat16", {n: shapes[n] for n in names}) as out:
            for offset, name in enumerate(names):
                count = _numel(shapes[name])
                tiled = block.roll(offset).repeat(-(-count // BLOCK))[:count]
                out.write(name, tiled.reshape(shapes[name]) * 0.02)
                weight_map[name] = file
        sizes.append((root / file).stat().st_size)
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    return sizes


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


if __name__ == "__main__":
    sys.exit(main())
