"""How long the CLI takes to answer: `qvl-trt --help`, `qvl-trt gpus` and a no-op build (every
stage asked for is unchanged, so the build only checks and skips), each the median of
repeated runs, beside the interpreter's own start (`python -c pass`) measured in the same run,
interleaved with them.

python scripts/bench_cli_startup.py [--build DIR] [--repeats N]

Without --build it writes a tiny checkpoint and builds its vision engine (TensorRT-RTX, a
minute or so) in a temporary folder first; the no-op build is then `qvl-trt build --resume
DIR --only vision`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "qvl_trt.cli"]


def _seconds(cmd: list[str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} exited with {done.returncode}: "
                         f"{done.stderr.strip()[-400:]}")
    return took


def _tiny_build(root: Path) -> Path:
    from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(root / "tiny-qwen3-vl")
    build = root / "build"
    print(f"building the vision engine of a tiny checkpoint in {build} ...", flush=True)
    subprocess.run([*CLI, "build", "--model", str(model), "--gpu", "4090d", "--out",
                    str(build), "--only", "vision"], check=True, capture_output=True)
    return build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, help="A build folder whose vision stage is done "
                        "[default: make one in a temporary folder].")
    parser.add_argument("--repeats", type=int, default=9, help="Runs of each command.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build = args.build or _tiny_build(Path(tmp))
        commands = {
            "python -c pass (baseline)": [sys.executable, "-c", "pass"],
            "qvl-trt --help": [*CLI, "--help"],
            "qvl-trt gpus": [*CLI, "gpus"],
            "qvl-trt build (no-op)": [*CLI, "build", "--resume", str(build), "--only",
                                      "vision"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):  # interleaved: load on the machine hits all alike
            for name, cmd in commands.items():
                times[name].append(_seconds(cmd))
    base = statistics.median(times["python -c pass (baseline)"])
    print(f"median of {args.repeats} runs each")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"  {name:28s} {median:6.3f} s  {median / base:5.1f}x the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
