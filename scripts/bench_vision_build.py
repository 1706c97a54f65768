"""Vision engine build cost at the real Qwen3-VL-2B vision dimensions (random bf16 weights):
ONNX export time and peak memory, TensorRT-RTX FP16 engine build time and peak memory,
engine size and the activation memory TensorRT reports at the profile's largest image.

    python scripts/bench_vision_build.py [--gpu 4090d] [--compare] [--keep DIR]

Each step runs in its own child process, so its peak RSS is its own. The graph is the one
the build makes for TensorRT-RTX (attention as the ONNX `Attention` op, opset 23);
`--compare` also exports the graph made for full TensorRT (MatMul-Softmax-MatMul, opset 18)
and builds it with TensorRT-RTX in the same run, as the baseline for that choice. The
prototype this replaces took ~1 min to export and ~11 s to build on 2 cores. Other work on
the machine skews wall times: CPU times and the load average before and after are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROTOTYPE = {"export_s": 60.0, "build_s": 11.0}


def write_vision_checkpoint(out: Path) -> Path:
    """The released 2B config.json plus random bf16 weights for the vision tower only."""
    import torch
    from safetensors.torch import save_file

    from qvl_trt.checkpoint import VISION_PREFIX, open_checkpoint
    from qvl_trt.testing.tiny_checkpoint import write_config_only

    write_config_only(out, "2b")
    ckpt = open_checkpoint(out)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in ckpt.expected.items():
        if name.startswith(VISION_PREFIX):
            noise = torch.randn(shape, generator=generator)
            value = 1.0 + 0.1 * noise if len(shape) == 1 and "norm" in name else 0.02 * noise
            tensors[name] = value.to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out


def _child(argv: list[str]) -> dict:
    """Run one step of this script in a child process; its JSON result line."""
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"step {argv[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds(who: int) -> float:
    """User + system CPU time: less skewed than wall time by other work on the machine."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def step_export(ckpt_dir: str, out: str, edition: str) -> None:
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.profiles import TrtEdition
    from qvl_trt.vision.export import export_vision_onnx

    ckpt = open_checkpoint(ckpt_dir, validate=False)  # vision weights only
    started = time.perf_counter()
    export_vision_onnx(ckpt, Path(out), dtype="float16", edition=TrtEdition(edition))
    # Wall time of the whole step, checkpoint read included; the peak is this process's.
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_mib": _peak_rss_mib(),
                      "cpu_s": _cpu_seconds(resource.RUSAGE_SELF)}))


def step_build(ckpt_dir: str, folder: str, gpu: str, onnx: str) -> None:
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.profiles import load_profile
    from qvl_trt.vision.engine import EngineBuildConfig, build_vision_engine
    from qvl_trt.vision.spec import patch_range, vision_graph_spec

    ckpt = open_checkpoint(ckpt_dir, validate=False)
    profile = load_profile(gpu)
    spec = vision_graph_spec(ckpt.vision, "float16")
    started = time.perf_counter()
    config = build_vision_engine(Path(folder), EngineBuildConfig(
        edition=profile.gpu.trt_edition, dtype="float16", onnx=onnx,
        compute_capabilities=(profile.gpu.compute_capability,),
        patches=patch_range(ckpt.vision, profile.limits),
        builder_optimization_level=profile.vision_build.builder_optimization_level,
        workspace_gib=profile.vision_build.workspace_gib, inputs=spec.inputs,
        outputs=spec.outputs, sources={}))
    log = (Path(folder) / "build.log").read_text()
    activation = re.findall(r"Total Activation Memory: (\d+) bytes", log)
    # Wall time of the build call: child start, TensorRT import, parse, build, write.
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "cpu_s": _cpu_seconds(resource.RUSAGE_CHILDREN),
                      "peak_rss_mib": config["build"]["peak_rss_mib"],
                      "engine_bytes": config["engine_bytes"],
                      "activation_bytes": int(activation[-1]) if activation else None,
                      "patches": config["patches"], "trt_version": config["trt_version"]}))


def measure(ckpt: Path, root: Path, gpu: str, edition: str) -> dict:
    from qvl_trt.profiles import TrtEdition
    from qvl_trt.vision.export import OPSETS

    opset = OPSETS[TrtEdition(edition)]
    folder = root / f"opset{opset}"
    folder.mkdir()
    export = _child(["export", str(ckpt), str(folder / "onnx"), edition])
    build = _child(["build", str(ckpt), str(folder), gpu, "onnx/model.onnx"])
    return {"opset": opset, "export_s": export["seconds"], "export_peak_mib": export["peak_mib"],
            "export_cpu_s": export["cpu_s"], "build_cpu_s": build["cpu_s"],
            "build_s": build["seconds"], "build_peak_mib": build["peak_rss_mib"],
            "engine_mib": build["engine_bytes"] / 2**20,
            "activation_mib": (build["activation_bytes"] or 0) / 2**20,
            "patches": build["patches"], "trt_version": build["trt_version"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("export", "build"):
        {"export": step_export, "build": step_build}[sys.argv[1]](*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="4090d", help="GPU profile (TensorRT-RTX edition)")
    parser.add_argument("--compare", action="store_true",
                        help="also build the opset-18 graph (made for full TensorRT)")
    parser.add_argument("--keep", type=Path, help="keep the checkpoint, ONNX and engines here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-vision-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f} on {os.cpu_count()} cores")
    ckpt = write_vision_checkpoint(root / "ckpt-2b-vision")
    rows = [measure(ckpt, root, args.gpu, "tensorrt_rtx")]
    if args.compare:
        rows.append(measure(ckpt, root, args.gpu, "tensorrt"))
    load_after = os.getloadavg()
    patches = rows[0]["patches"]
    print(f"Qwen3-VL-2B vision tower (random bf16 weights) -> FP16, profile {args.gpu}, "
          f"TensorRT-RTX {rows[0]['trt_version']}, patches {patches['min']}..{patches['max']} "
          f"(opt {patches['opt']})")
    print(f"{'graph':<10} {'export s':>9} {'(CPU s)':>8} {'export MiB':>11} {'build s':>8} "
          f"{'(CPU s)':>8} {'build MiB':>10} {'engine MiB':>11} {'activ. MiB':>11}")
    for r in rows:
        print(f"opset {r['opset']:<4} {r['export_s']:>9.1f} {r['export_cpu_s']:>8.1f} "
              f"{r['export_peak_mib']:>11.0f} {r['build_s']:>8.1f} {r['build_cpu_s']:>8.1f} "
              f"{r['build_peak_mib']:>10.0f} {r['engine_mib']:>11.0f} "
              f"{r['activation_mib']:>11.0f}")
    ours = rows[0]
    print(f"vs prototype (~60 s export, ~11 s build, 2 cores): export "
          f"{ours['export_s'] / PROTOTYPE['export_s']:.2f}x, build "
          f"{ours['build_s'] / PROTOTYPE['build_s']:.2f}x the prototype's time")
    if len(rows) > 1:
        base = rows[1]
        print(f"opset 23 vs opset 18 (same run): export {ours['export_s'] / base['export_s']:.2f}x,"
              f" build {ours['build_s'] / base['build_s']:.2f}x (CPU time "
              f"{ours['build_cpu_s'] / base['build_cpu_s']:.2f}x), engine "
              f"{ours['engine_mib'] / base['engine_mib']:.2f}x, activation memory "
              f"{ours['activation_mib'] / max(base['activation_mib'], 1e-9):.2f}x")
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
