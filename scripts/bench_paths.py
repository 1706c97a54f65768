"""The ensemble and tensorrt_llm_bls paths of one running server, compared with a controlled
load: `qvl-trt bench`'s closed loop (qvl_trt.client.bench) at one concurrency, the two paths
interleaved round by round (the first path alternates), and around each run the server's
per-model counters read from its metrics port (successful requests, executions, compute time
nv_inference_compute_infer_duration_us, vision cache hits and misses) and the CPU time of each
model's python stub processes from /proc (user + system; the server must run on this machine
and `--repository` must be the folder it serves, which names its stubs).

--images fresh gives every run its own synthetic images (a seed per run: the vision cache
cannot answer any); --images shared gives both runs of a round the round's seed (the second
run of a round finds the first run's images in the vision cache), as two runs of `bench
--seed S` do.

The supervisor's end-to-end probe sends the ensemble a text-only request every few seconds;
those land in the ensemble's counters (the columns show them: ensemble requests beyond the
run's own).

    python scripts/bench_paths.py --url grpc://127.0.0.1:8001 --metrics-url
        http://127.0.0.1:8002/metrics --repository REPO [--rounds 3] [--concurrency 4]
        [--requests 40] [--synthetic 448x448] [--images fresh|shared] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from qvl_trt.client.bench import BenchEndpoint, BenchSettings, run_benchmark, synthetic_images
from qvl_trt.serve.progress import read_metrics, total
from qvl_trt.triton import contract as c

MODELS = c.ModelNames().all()
COUNTERS = {"req": "nv_inference_request_success", "exec": "nv_inference_exec_count",
            "infer_s": "nv_inference_compute_infer_duration_us",
            "hits": "qvl_vision_cache_hits_total", "misses": "qvl_vision_cache_misses_total"}
TICKS = os.sysconf("SC_CLK_TCK")


def read_counters(url: str) -> dict[tuple[str, str], float]:
    """(counter, model) -> value, for COUNTERS and MODELS."""
    samples = read_metrics(url, timeout_s=10)
    assert samples is not None, f"{url} does not answer"
    return {(key, model): total(samples, name, model=model) *
            (1e-6 if name.endswith("_us") else 1.0)
            for key, name in COUNTERS.items() for model in MODELS}


def stub_cpu(repository: Path) -> dict[str, float]:
    """Model -> CPU seconds (user + system) of its python stub processes serving
    `repository`, summed over instances."""
    cpu = dict.fromkeys(MODELS, 0.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        for model in MODELS:
            if str(repository / model / "1" / "model.py").encode() in args:
                fields = stat.rsplit(")", 1)[1].split()
                cpu[model] += (int(fields[11]) + int(fields[12])) / TICKS
    return cpu


def machine_busy() -> float:
    """CPU seconds all cores of the machine spent busy (not idle or waiting) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


def one_run(settings: BenchSettings, seed: int, spec: tuple[int, int], args) -> dict:
    """A run's metrics, counter deltas, stub CPU and the CPU the rest of the machine used
    meanwhile (busy time less the stubs' and this client's; tritonserver's own process is
    in it)."""
    before, cpu_before = read_counters(args.metrics_url), stub_cpu(args.repository)
    busy, mine = machine_busy(), sum(os.times()[:2])
    report = run_benchmark(settings, synthetic_images(*spec, seed), source=f"seed {seed}")
    busy, mine = machine_busy() - busy, sum(os.times()[:2]) - mine
    after, cpu_after = read_counters(args.metrics_url), stub_cpu(args.repository)
    (level,) = report.levels
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    cpu = {m: cpu_after[m] - cpu_before[m] for m in MODELS}
    return {"level": level, "delta": delta, "cpu": cpu,
            "others": busy - mine - sum(cpu.values())}


def show(endpoint: BenchEndpoint, seed: int, run: dict) -> None:
    lv, d, cpu = run["level"], run["delta"], run["cpu"]
    ve = c.VISION_ENCODER
    print(f"{endpoint.value:>8} seed {seed:<4} {lv.request_throughput:6.2f} req/s  "
          f"{lv.errors} errors  vision: {d.get(('req', ve), 0):4.0f} req "
          f"{d.get(('exec', ve), 0):4.0f} exec {d.get(('misses', ve), 0):4.0f} miss "
          f"{d.get(('hits', ve), 0):4.0f} hit  compute {d.get(('infer_s', ve), 0):6.2f} s  "
          f"stub CPU {cpu[ve]:6.2f} s  rest of machine {run['others']:6.2f} s in "
          f"{lv.duration_s:.1f} s")
    print("          stub CPU s: " + ", ".join(f"{m} {cpu[m]:.2f}" for m in MODELS) +
          f"; ensemble req {d.get(('req', c.ENSEMBLE), 0):.0f}, bls req "
          f"{d.get(('req', c.TENSORRT_LLM_BLS), 0):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="grpc://127.0.0.1:8001")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--repository", type=Path, required=True,
                        help="the repository folder the server serves (names its stubs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--synthetic", default="448x448", help="WIDTHxHEIGHT of the images")
    parser.add_argument("--images", choices=("fresh", "shared"), default="fresh")
    parser.add_argument("--seed", type=int, default=1000, help="the first round's seed")
    args = parser.parse_args()
    args.repository = args.repository.resolve()
    spec = tuple(int(v) for v in args.synthetic.split("x"))
    base = BenchSettings(args.url, (args.concurrency,), args.requests, args.max_tokens,
                         warmup=0)
    # One unmeasured run per path first: both load their code paths before the first round.
    for endpoint in BenchEndpoint.ENSEMBLE, BenchEndpoint.BLS:
        run_benchmark(replace(base, endpoint=endpoint, requests=2),
                      synthetic_images(*spec, args.seed - 1), source="warm-up")
    totals: dict[BenchEndpoint, list[dict]] = {BenchEndpoint.ENSEMBLE: [], BenchEndpoint.BLS: []}
    for r in range(args.rounds):
        order = list(totals) if r % 2 == 0 else list(totals)[::-1]
        print(f"round {r + 1}: {order[0].value} first, images {args.images}")
        for k, endpoint in enumerate(order):
            seed = args.seed + r * 2 + (k if args.images == "fresh" else 0)
            run = one_run(replace(base, endpoint=endpoint), seed, spec, args)
            totals[endpoint].append(run)
            show(endpoint, seed, run)
    for endpoint, runs in totals.items():
        rate = sum(run["level"].request_throughput for run in runs) / len(runs)
        cpu = sum(run["cpu"][c.VISION_ENCODER] for run in runs)
        misses = sum(run["delta"].get(("misses", c.VISION_ENCODER), 0) for run in runs)
        print(f"{endpoint.value}: mean {rate:.2f} req/s over {len(runs)} runs; vision_encoder "
              f"stub CPU {cpu:.2f} s for {misses:.0f} images run through the tower")


if __name__ == "__main__":
    main()
