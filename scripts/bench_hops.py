"""Bytes and time of a request's tensors between the models of the served pipeline: one
1920x1080 JPEG question through a real tritonserver, on both entry points (the ensemble and
tensorrt_llm_bls), every python model timed by a benchmark fixture
(qvl_trt.testing.hop_timer: execute entered / returned, bytes of each input and output
tensor), one token per request.

Sizes: the checkpoint is tiny but its tensor-sizing dimensions are the 2B's (text hidden 2048,
head_dim 128, 3 DeepStack layers, patch 16, temporal 2) and the limits are the 4090d
profile's (max_seq_len 8192, 2 Mpixel images); the reference flavor runs in float16, so the
prompt table is the fp16 table the 4090d engine takes. Everything a hop moves therefore has
the 2B/4090d size; only compute (thin layers, outside the hops' times) differs.

A hop's time runs from the producer's execute returning (or, for a decoupled BLS caller, its
execute being entered; for the client, the send) to the consumer's execute being entered:
the python backend's shared-memory copies out of and into the stub processes, Triton's
scheduling, and any code of a BLS step the tensors pass through. The vision cache is warm
after the first request (the tensors are the same either way). Prints per hop the tensors
and bytes it carries and the median time over --repeat interleaved requests per entry point
(with min-max), then each path's total, and for context the time inside preprocessing's and
vision_encoder's execute (the vision cache hits: no tower runs there).

    python scripts/bench_hops.py [--repeat 10] [--size 1920x1080] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_preprocess import photo_like

from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.client.generate import GenerateClient, GenerateRequest
from qvl_trt.dtypes import Dtype
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.hop_timer import install_hop_timer, read_calls
from qvl_trt.testing.tiny_checkpoint import TinyDims, write_tiny_checkpoint
from qvl_trt.triton import contract as c
from qvl_trt.triton.layout import VERSION
from qvl_trt.triton.options import Flavor
from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

QUESTION = "Describe this image in one word."
PROFILE = "4090d"
# The 2B's tensor-sizing dimensions (its config.json: qvl_trt/testing/tiny_checkpoint.py
# RELEASED) with tiny compute: 2 heads of 128, 4 thin
# layers, a 3-block vision tower of width 32 with its 3 DeepStack taps.
DIMS_2B_SIZED = TinyDims(text_hidden=2048, text_layers=4, text_heads=2, text_kv_heads=1,
                         head_dim=128, text_intermediate=64, vision_depth=3,
                         deepstack_visual_indexes=(0, 1, 2))
MODELS = (c.PREPROCESSING, c.VISION_ENCODER, c.POSTPROCESSING, c.TENSORRT_LLM,
          c.TENSORRT_LLM_BLS)
CLIENT = "client"


@dataclass(frozen=True)
class Hop:
    """Tensors moving from `source` to `target`: the time from `since` (a model's event, or
    the client's send) to `target` being entered; `carried` names where the bytes are read
    (a model's inputs or outputs)."""

    label: str
    target: str
    since: tuple[str, str]  # (model or CLIENT, "entered" | "returned" | "sent")
    carried: tuple[tuple[str, str], ...]  # (model, "inputs" | "outputs")


PATHS: dict[str, tuple[Hop, ...]] = {
    c.ENSEMBLE: (
        Hop("client -> preprocessing", c.PREPROCESSING, (CLIENT, "sent"),
            ((c.PREPROCESSING, "inputs"),)),
        Hop("preprocessing -> vision_encoder", c.VISION_ENCODER, (c.PREPROCESSING, "returned"),
            ((c.VISION_ENCODER, "inputs"),)),
        Hop("preprocessing, vision_encoder -> postprocessing", c.POSTPROCESSING,
            (c.VISION_ENCODER, "returned"), ((c.POSTPROCESSING, "inputs"),)),
        Hop("postprocessing -> tensorrt_llm", c.TENSORRT_LLM, (c.POSTPROCESSING, "entered"),
            ((c.TENSORRT_LLM, "inputs"),)),
    ),
    c.TENSORRT_LLM_BLS: (
        Hop("client -> tensorrt_llm_bls", c.TENSORRT_LLM_BLS, (CLIENT, "sent"),
            ((c.TENSORRT_LLM_BLS, "inputs"),)),
        Hop("tensorrt_llm_bls -> preprocessing", c.PREPROCESSING,
            (c.TENSORRT_LLM_BLS, "entered"), ((c.PREPROCESSING, "inputs"),)),
        Hop("preprocessing -> tensorrt_llm_bls -> vision_encoder", c.VISION_ENCODER,
            (c.PREPROCESSING, "returned"),
            ((c.PREPROCESSING, "outputs"), (c.VISION_ENCODER, "inputs"))),
        Hop("vision_encoder -> tensorrt_llm_bls -> tensorrt_llm", c.TENSORRT_LLM,
            (c.VISION_ENCODER, "returned"),
            ((c.VISION_ENCODER, "outputs"), (c.TENSORRT_LLM, "inputs"))),
    ),
}


def build_repo(root: Path) -> Path:
    """The reference-flavor repository of the 2B-sized tiny checkpoint with the 4090d limits,
    every python model timed."""
    ckpt = root / "ckpt"
    if not ckpt.exists():
        write_tiny_checkpoint(ckpt, dims=DIMS_2B_SIZED, dtype=Dtype.BFLOAT16)
    build = root / "build"
    run_build(BuildOptions(model=str(ckpt), gpu=PROFILE), build, only=(Stage.LLM_CHECKPOINT,))
    repo = write_repo([BuildInput(build)], root / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  device="cpu", reference_dtype=Dtype.FLOAT16),
                      force=True).path
    for model in MODELS:
        install_hop_timer(repo / model / VERSION)
    return repo


def one_request(repo: Path, url: str, path: str, image: bytes) -> dict[str, dict]:
    """Send the request on `path`; every model's events (entered, returned, inputs,
    outputs) and the client's send time, all CLOCK_MONOTONIC ns."""
    seen = {m: len(read_calls(repo / m / VERSION)) for m in MODELS}
    with GenerateClient(url, model=path) as client:
        sent = time.monotonic_ns()
        client.generate(GenerateRequest(QUESTION, images=(image,), max_tokens=1,
                                        temperature=0.0))
    events: dict[str, dict] = {CLIENT: {"sent": sent}}
    for model in MODELS:
        calls = read_calls(repo / model / VERSION, skip=seen[model])
        if len(calls) > 1:
            raise SystemExit(f"{model} ran {len(calls)} times for one request")
        if calls:
            call = calls[0]
            events[model] = {"entered": call.entered_ns, "returned": call.returned_ns,
                             "inputs": call.inputs[0], "outputs": dict(
                                 call.outputs[0]) if call.outputs else {}}
    return events


def carried_bytes(hop: Hop, events: dict[str, dict]) -> dict[str, int]:
    """Tensor -> bytes the hop moves (a tensor passing a BLS step counted on both sides)."""
    out: dict[str, int] = {}
    for model, side in hop.carried:
        for name, size in events[model][side].items():
            out[f"{name}" if side == "inputs" else f"{name} (out)"] = size
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def describe(tensors: dict[str, int]) -> str:
    big = sorted(((n, s) for n, s in tensors.items() if s >= 64 * 1024), key=lambda t: -t[1])
    small = [s for s in tensors.values() if s < 64 * 1024]
    parts = [f"{n} {s / 2**20:.2f} MiB" for n, s in big]
    if small:
        parts.append(f"{len(small)} small ({sum(small) / 1024:.1f} KiB)")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="requests per entry point")
    parser.add_argument("--size", default="1920x1080", help="JPEG image WxH")
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end); the checkpoint there is reused")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    image = photo_like(width, height, "jpeg")
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    with tempfile.TemporaryDirectory(prefix="qvl-bench-hops-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        repo = build_repo(root)
        runs: dict[str, list[dict]] = {p: [] for p in PATHS}
        with TritonServer(ServerOptions(repo, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            for path in PATHS:  # warm-up: the vision tower runs once, then its cache hits
                one_request(repo, server.grpc_url, path, image)
            for r in range(args.repeat):
                for path in list(PATHS)[r % 2:] + list(PATHS)[:r % 2]:
                    runs[path].append(one_request(repo, server.grpc_url, path, image))
        print(f"revision {revision}; {width}x{height} JPEG of {len(image) / 1024:.0f} KiB; "
              f"2B-sized tensors ({PROFILE} limits, fp16 prompt table); median [min-max] of "
              f"{args.repeat} interleaved requests per entry point")
        for path, hops in PATHS.items():
            print(f"\n{path}:")
            total_bytes, totals = 0, [0.0] * args.repeat
            for hop in hops:
                moved = carried_bytes(hop, runs[path][0])
                ms = []
                for i, events in enumerate(runs[path]):
                    source, event = hop.since
                    ms.append((events[hop.target]["entered"] - events[source][event]) / 1e6)
                    totals[i] += ms[-1]
                total_bytes += sum(moved.values())
                print(f"  {hop.label:<52} {mib(sum(moved.values()))} "
                      f"{statistics.median(ms):7.1f} ms [{min(ms):.1f}-{max(ms):.1f}]")
                print(f"      {describe(moved)}")
            print(f"  {'total':<52} {mib(total_bytes)} {statistics.median(totals):7.1f} ms "
                  f"[{min(totals):.1f}-{max(totals):.1f}]")
            for model in (c.PREPROCESSING, c.VISION_ENCODER):  # context: not moves
                ms = [(e[model]["returned"] - e[model]["entered"]) / 1e6 for e in runs[path]]
                print(f"  (in {model}'s execute: {statistics.median(ms):.1f} ms "
                      f"[{min(ms):.1f}-{max(ms):.1f}])")


if __name__ == "__main__":
    main()
