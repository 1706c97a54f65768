"""What the served pipeline itself costs per token: tensorrt_llm replaced by a load generator
that makes tokens at a fixed rate (qvl_trt.testing.token_generator, a benchmark fixture put
into this script's own repository only), N concurrent streams through the ensemble and
through tensorrt_llm_bls against the same generator called directly over gRPC streaming,
interleaved round by round. Prints delivered tokens/s per path and their ratio to the direct
rate (median and range over the rounds); per token, the CPU time and context switches of
tritonserver, of each python model's stubs and of this client, the CPU the rest of the
machine used meanwhile, and how many tokens a response carried (postprocessing merges
tokens that arrive while it is sending); and, at one stream, the per-token latency each path
adds (median inter-token time, and end to end per token) over the direct call.

Everything runs on this machine: where the cores are few and shared, every path is bound by
CPU and the ratio compares what each path spends per token (the printed breakdown shows
where). The bound it checks: at 16 streams x 250 tokens/s the ensemble delivers >= 90% of
the direct rate and adds <= 0.2 ms per token at one stream. Recorded runs:
docs/benchmarks.md.

Usage: python scripts/bench_pipeline_overhead.py [--rate 250] [--streams 1 16]
       [--tokens 500] [--rounds 3] [--paths ensemble tensorrt_llm_bls] [--work-dir DIR]

Building the repository needs transformers (the tiny checkpoint); serving it through the
nvidia-pytriton wheel needs numpy < 2 (qvl_trt/serve/server.py says why). Where one Python
environment cannot have both (a GPU host whose transformers needs numpy 2), build in one and
serve from the other, with the same --streams, --tokens and --rate:

    python scripts/bench_pipeline_overhead.py --build-only DIR ...   # numpy 2, transformers
    python scripts/bench_pipeline_overhead.py --repo DIR/repo ...    # numpy < 2, pytriton
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from qvl_trt.client.generate import GenerateClient, GenerateRequest, ensemble_request
from qvl_trt.deps import require
from qvl_trt.mm.rope import MropeTable
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.tiny_repository import build_generator_repo
from qvl_trt.testing.token_generator import SETTINGS
from qvl_trt.triton import contract as c
from qvl_trt.triton.layout import VERSION
from qvl_trt.triton.pbconfig import read_config

PROMPT = "Describe the benchmark in a few words."
DIRECT = "direct"
PIPELINES = (c.ENSEMBLE, c.TENSORRT_LLM_BLS)


@dataclass(frozen=True)
class Stream:
    sent: float
    arrivals: tuple[float, ...]  # perf_counter per response that carried tokens
    tokens: int

    @property
    def end(self) -> float:
        return self.arrivals[-1]


def _request_fields(max_tokens: int) -> dict[str, tuple[str, np.ndarray]]:
    """The ensemble's inputs for PROMPT: name -> (Triton dtype, value)."""
    types = {s.name: s.data_type for s in c.ENSEMBLE_INPUTS}
    tensors = ensemble_request(GenerateRequest(PROMPT, max_tokens=max_tokens)).to_tensors()
    return {name: (types[name], value) for name, value in tensors.items()}


def _infer_inputs(grpc, values: dict[str, tuple[str, np.ndarray]]) -> list:
    inputs = []
    for name, (dtype, value) in values.items():
        tensor = grpc.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def llm_inputs(grpc, url: str, max_tokens: int, mrope: MropeTable) \
        -> dict[str, tuple[str, np.ndarray]]:
    """tensorrt_llm's inputs for PROMPT, as the ensemble's earlier steps and postprocessing
    make them (`mrope`: the table postprocessing builds from the position ids)."""
    client = grpc.InferenceServerClient(url)
    fields = _request_fields(max_tokens)
    pre = client.infer(c.PREPROCESSING, _infer_inputs(grpc, fields))
    vision = client.infer(c.VISION_ENCODER, _infer_inputs(grpc, {
        s.name: (s.data_type, pre.as_numpy(s.name)) for s in c.VISION_INPUTS}))
    client.close()
    table = vision.get_output(c.PROMPT_EMBEDDING_TABLE).datatype
    specs = {s.name: s.data_type for s in c.POSTPROCESSING_INPUTS}
    specs[c.PROMPT_EMBEDDING_TABLE] = table  # the build's dtype
    out = {}
    for name, dtype in specs.items():
        result = pre if pre.get_output(name) is not None else vision
        if result.get_output(name) is not None:
            out[name] = (dtype, result.as_numpy(name))
    _, positions = out.pop(c.MROPE_POSITION_IDS)
    out[c.MROPE_ROTARY_COS_SIN] = ("FP32", mrope(positions[0])[None])
    return out


def run_streams(grpc, url: str, path: str, n: int, llm: dict, max_tokens: int) -> list[Stream]:
    """`n` concurrent streams on `path`, each on its own gRPC stream, all read by one asyncio
    client (tritonclient.grpc.aio) in this process: on a machine with few cores the load
    generator competes with the server it measures, so it is the leanest client at hand (a
    thread and a blocking client per stream cost about twice its CPU per response)."""
    if path == DIRECT:
        model, fields, outputs = c.TENSORRT_LLM, llm, [c.OUTPUT_IDS, c.SEQUENCE_LENGTH]
    else:
        model, outputs = path, None
        fields = _request_fields(max_tokens)
    aio = require("tritonclient.grpc.aio", extra="serve", why="talk to Triton over gRPC")

    async def one(client) -> Stream:
        inputs = _infer_inputs(grpc, fields)
        requested = [grpc.InferRequestedOutput(o) for o in outputs] if outputs else None
        answered = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "outputs": requested,
                   "request_id": uuid.uuid4().hex}
            await answered.wait()  # the stream stays open until the answer is complete

        sent = time.perf_counter()
        arrivals, tokens = [], 0
        async for result, error in client.stream_infer(requests()):
            at = time.perf_counter()
            if error is not None:
                raise RuntimeError(f"{path}: {error}")
            if path == DIRECT:
                ids = result.as_numpy(c.OUTPUT_IDS)
                new = 0 if ids is None else ids.shape[-1]
            else:
                done = result.as_numpy(c.COMPLETION_TOKENS)
                new = 0 if done is None else int(done.reshape(-1)[0]) - tokens
            tokens += new
            if new:
                arrivals.append(at)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        answered.set()
        return Stream(sent, tuple(arrivals), tokens)

    async def streams() -> list[Stream]:
        client = aio.InferenceServerClient(url)
        try:
            return list(await asyncio.gather(*(one(client) for _ in range(n))))
        finally:
            await client.close()

    return asyncio.run(streams())


@dataclass(frozen=True)
class Usage:
    """What a process has used so far (all its threads): CPU seconds, context switches."""

    cpu: float = 0.0
    switches: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.cpu + other.cpu, self.switches + other.switches)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu - other.cpu, self.switches - other.switches)


def usage(pid: int | str) -> Usage:
    """`pid`'s usage, or this process's ("self", whose per-run threads have ended: the
    kernel's totals then include them)."""
    if pid == "self":
        own = resource.getrusage(resource.RUSAGE_SELF)
        return Usage(own.ru_utime + own.ru_stime, own.ru_nvcsw + own.ru_nivcsw)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread has just ended
            continue
        switches += sum(int(line.split()[1]) for line in status.splitlines()
                        if "ctxt_switches:" in line)
    return Usage((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), switches)


def processes(server: TritonServer) -> dict[str, list[int | str]]:
    """Whose usage to count: tritonserver itself, each python model's stubs (by model, its
    instances together) and this client."""
    found: dict[str, list[int | str]] = {"tritonserver": [server.process.pid]}
    for instance, pid in sorted(server.stubs().items()):
        found.setdefault(instance.rsplit("_", 2)[0], []).append(pid)
    found["client"] = ["self"]
    return found


def usage_now(procs: dict[str, list[int | str]]) -> dict[str, Usage]:
    return {name: sum((usage(p) for p in pids), Usage()) for name, pids in procs.items()}


def machine_busy() -> float:
    """CPU seconds the whole machine has spent not idle (all cores)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def delivered_rate(streams: list[Stream]) -> float:
    first = min(s.sent for s in streams)
    return sum(s.tokens for s in streams) / (max(s.end for s in streams) - first)


def inter_token(streams: list[Stream]) -> float:
    return statistics.median(b - a for s in streams for a, b in pairwise(s.arrivals))


def end_to_end_per_token(streams: list[Stream]) -> float:
    return statistics.median((s.end - s.sent) / s.tokens for s in streams)


def report(n: int, rate: float, paths: tuple[str, ...], runs: dict[str, list[list[Stream]]],
           used: dict[str, dict[str, Usage]], others: dict[str, float],
           wall: dict[str, float]) -> None:
    """Delivered rates and their ratio to the direct one (median and range over the rounds),
    then where the CPU went per token."""
    rates = {p: [delivered_rate(s) for s in runs[p]] for p in paths}
    print(f"\n{n} stream(s): ideal {n * rate:,.0f} tokens/s")
    for path in paths:
        line = f"  {path:<17} {statistics.median(rates[path]):9,.0f} tokens/s"
        if path != DIRECT:
            ratios = [a / b for a, b in zip(rates[path], rates[DIRECT], strict=True)]
            line += (f"  {statistics.median(ratios):6.1%} of direct (rounds "
                     f"{min(ratios):.1%}-{max(ratios):.1%})")
        print(line)
    print("  per token, all rounds: CPU microseconds (context switches) by process; the rest "
          "of the machine in cores busy; tokens per response")
    for path in paths:
        tokens = sum(s.tokens for run in runs[path] for s in run)
        responses = sum(len(s.arrivals) for run in runs[path] for s in run)
        parts = "  ".join(f"{k} {u.cpu / tokens * 1e6:.0f} ({u.switches / tokens:.1f})"
                          for k, u in used[path].items() if u.cpu / tokens >= 1e-6)
        total = sum(used[path].values(), Usage())
        print(f"    {path:<17} total {total.cpu / tokens * 1e6:4.0f} "
              f"({total.switches / tokens:.1f}): {parts}; others "
              f"{others[path] / wall[path]:.2f}; {tokens / responses:.2f} tokens per response")


def check_built_for(repo: Path, streams: int, rate: float) -> None:
    """Refuse a --repo whose generator runs at another rate, or whose in-flight batch is
    smaller than the streams asked for (they would queue and read as overhead)."""
    llm = repo / c.TENSORRT_LLM
    settings = llm / VERSION / SETTINGS
    if not settings.is_file():
        raise SystemExit(f"--repo {repo}: no token generator at {settings}; write the "
                         "repository with --build-only")
    built_rate = json.loads(settings.read_text())["tokens_per_s"]
    batch = read_config(llm).max_batch_size
    if built_rate != rate or batch < streams:
        raise SystemExit(f"--repo {repo} was built for {built_rate:g} tokens/s and {batch} "
                         f"streams, asked {rate:g} and {streams}; build it again with "
                         "--build-only and the same --rate and --streams")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=250.0, help="tokens/s per stream")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=500, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PIPELINES, default=list(PIPELINES),
                        help="the served paths to compare with the direct call")
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--build-only", type=Path, metavar="DIR",
                        help="write the generator repository into DIR/repo and stop")
    parser.add_argument("--repo", type=Path, help="serve this repository, written by "
                        "--build-only with the same --streams, --tokens and --rate")
    args = parser.parse_args()
    if args.build_only:
        repo = build_generator_repo(args.build_only, streams=max(args.streams),
                                    tokens=args.tokens, tokens_per_s=args.rate)
        print(f"wrote {repo.path}; serve it with --repo {repo.path}")
        return
    grpc = require("tritonclient.grpc", extra="serve", why="talk to Triton over gRPC")
    with tempfile.TemporaryDirectory(prefix="qvl-bench-pipe-") as tmp:
        root = args.work_dir or Path(tmp)
        if args.repo:
            repo_path = args.repo
            check_built_for(repo_path, max(args.streams), args.rate)
        else:
            repo_path = build_generator_repo(root, streams=max(args.streams),
                                             tokens=args.tokens, tokens_per_s=args.rate).path
        with TritonServer(ServerOptions(repo_path, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            url = server.grpc_url
            with GenerateClient(url) as client:  # postprocessing's MRoPE settings
                post = c.config_parameters(client.model_config(c.POSTPROCESSING))
            mrope = c.PostprocessingParameters.from_parameters(post).mrope_table()
            llm = llm_inputs(grpc, url, args.tokens, mrope)
            paths = (DIRECT, *args.paths)
            for path in paths:  # warm-up
                run_streams(grpc, url, path, 1, llm, 8)
            print(f"generator: {args.rate:g} tokens/s per stream, {args.tokens} tokens per "
                  f"request, {args.rounds} interleaved rounds (medians)")
            procs = processes(server)
            for n in args.streams:
                runs: dict[str, list[list[Stream]]] = {p: [] for p in paths}
                used = {p: dict.fromkeys(procs, Usage()) for p in paths}
                others = dict.fromkeys(paths, 0.0)  # CPU seconds of the rest of the machine
                wall = dict.fromkeys(paths, 0.0)
                for r in range(args.rounds):
                    for path in paths[r % len(paths):] + paths[: r % len(paths)]:
                        before, busy, t0 = usage_now(procs), machine_busy(), time.perf_counter()
                        runs[path].append(run_streams(grpc, url, path, n, llm, args.tokens))
                        after, spent = usage_now(procs), time.perf_counter() - t0
                        delta = {k: after[k] - before[k] for k in procs}
                        used[path] = {k: used[path][k] + delta[k] for k in procs}
                        others[path] += machine_busy() - busy - sum(d.cpu for d in delta.values())
                        wall[path] += spent
                report(n, args.rate, paths, runs, used, others, wall)
                if n == 1:
                    gap = {p: statistics.median(inter_token(s) for s in runs[p]) for p in paths}
                    e2e = {p: statistics.median(end_to_end_per_token(s) for s in runs[p])
                           for p in paths}
                    for path in paths[1:]:
                        print(f"  {path} adds per token: inter-token "
                              f"{(gap[path] - gap[DIRECT]) * 1e3:+.3f} ms, end to end "
                              f"{(e2e[path] - e2e[DIRECT]) * 1e3:+.3f} ms "
                              f"(direct: {gap[DIRECT] * 1e3:.3f} ms between tokens)")
            print("\nbound: 16 streams x 250 tokens/s, ensemble >= 90% of direct; "
                  "<= 0.2 ms added per token at one stream")


if __name__ == "__main__":
    main()
