"""Time of the weight-only INT8/INT4 checkpoint conversion against the fp16 conversion of the
same checkpoint, measured in the same run, interleaved.

Writes the released config of Qwen3-VL-2B (or 4B/8B), cut to --layers decoder layers, with
random bf16 safetensors shards of the real shapes (scripts/measure_convert_memory.py's
writer) into a temporary folder, then converts it round after round in the order fp16,
int8, int4 (a child process each, the output removed before the next; one untimed fp16
conversion first so that every timed one reads the shards from the page cache). Each child
reports convert_checkpoint's own seconds (not the interpreter's start-up nor torch's
import); the script prints every round and the median of each mode over the median of fp16.
The writes go through the page cache to the disk of --tmp-dir: on a tmpfs (/dev/shm) the
figures are the conversion's CPU time without the disk's.

python scripts/bench_convert_weight_only.py [--variant 2b] [--layers 6] [--rounds 3]
                                            [--weights int8,int4] [--tmp-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure_convert_memory import write_random_shards

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.testing.tiny_checkpoint import write_config_only

# torch and safetensors are imported before convert_checkpoint's clock starts: their import
# time is the same in every mode and would only pull the ratios towards 1.
CHILD = """
import sys
import safetensors.torch, torch
from qvl_trt.llm.convert import convert_checkpoint
done = convert_checkpoint(sys.argv[1], sys.argv[2], max_seq_len=8192, dtype="float16",
                          weights=sys.argv[3])
print(done.seconds)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="2b", choices=("2b", "4b", "8b"))
    parser.add_argument("--layers", type=int, default=6,
                        help="decoder layers kept (the released count: all of them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", default="int8,int4",
                        help="comma-separated weight-only modes timed against fp16")
    parser.add_argument("--tmp-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = ["none"] + [m.strip() for m in args.weights.split(",") if m.strip()]

    with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix="qvl-convert-time-") as tmp:
        src = write_config_only(Path(tmp) / "hf", args.variant)
        config_path = src / "config.json"
        config = json.loads(config_path.read_text())
        text = config["text_config"]
        text["num_hidden_layers"] = min(args.layers, text["num_hidden_layers"])
        config_path.write_text(json.dumps(config, indent=2))
        started = time.perf_counter()
        shards = write_random_shards(src, open_checkpoint(src).expected)
        print(f"{args.variant}, {text['num_hidden_layers']} layers: wrote {len(shards)} random "
              f"bf16 shards ({sum(shards) / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - started:.0f} s; torch threads "
              f"{os.environ.get('OMP_NUM_THREADS', 'default')}", flush=True)

        def convert(mode: str) -> float:
            out = Path(tmp) / f"trtllm-{mode}"
            done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), mode],
                                  check=True, capture_output=True, text=True)
            shutil.rmtree(out)
            return float(done.stdout.split()[-1])

        convert("none")  # warm-up: the shards into the page cache
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        for round_ in range(args.rounds):
            for mode in modes:
                seconds[mode].append(convert(mode))
            print(f"round {round_ + 1}: " + ", ".join(
                f"{m} {seconds[m][-1]:.2f} s ({seconds[m][-1] / seconds['none'][-1]:.2f}x)"
                for m in modes), flush=True)
        base = statistics.median(seconds["none"])
        for mode in modes:
            median = statistics.median(seconds[mode])
            print(json.dumps({"variant": args.variant, "layers": text["num_hidden_layers"],
                              "weights": mode, "rounds": args.rounds,
                              "median_seconds": round(median, 2),
                              "over_fp16": round(median / base, 2)}))
        print("median time over fp16's: " + ", ".join(
            f"{m} {statistics.median(seconds[m]) / base:.2f}x" for m in modes[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
