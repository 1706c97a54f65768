"""The OpenAI gateway's per-token overhead: the same streamed chat requests sent to Triton
directly (tritonclient's asyncio gRPC client on tensorrt_llm_bls, exactly as the gateway sends
them: qvl_trt.gateway.upstream) and through the gateway (HTTP POST /v1/chat/completions,
server-sent events read with aiohttp's client), in alternating rounds at each concurrency.

Per concurrency level it prints the median request latency both ways and their ratio, the
latency the gateway adds per generated token (ms; the median over rounds of the difference
between a round's two batches), the gateway process's own CPU time per token it delivered
(ms, from /proc: what the gateway costs a machine whatever else runs) and, for scale, the CPU
time per token of the direct path's client (the same asyncio gRPC client the gateway holds).

It builds what tests/conftest.py builds (the tiny checkpoint, its converted LLM, the
reference-flavor repository), serves it with tritonserver and starts the gateway as the child
process `qvl-trt serve --openai-port` starts. The reference model decodes on the CPU: on a
busy machine latencies are noisy, the CPU time per token much less so.

Usage: python scripts/bench_gateway.py [--work-dir DIR] [--rounds N] [--max-tokens T]
       [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tiny_reference_repo import build_tiny_reference_repo

from qvl_trt.gateway.app import GatewayOptions
from qvl_trt.gateway.openai_api import ChatCompletionRequest
from qvl_trt.gateway.process import GatewayProcess
from qvl_trt.gateway.upstream import Upstream
from qvl_trt.triton.server import ServerOptions, TritonServer, free_ports

PROMPT = "Tell me a long story."


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct(upstream: Upstream, served, request: ChatCompletionRequest) -> tuple[float, int]:
    """(latency, tokens) of one request to Triton."""
    start = time.perf_counter()
    tokens = 0
    async for piece in upstream.generate(served, request):
        tokens = piece.completion_tokens
    return time.perf_counter() - start, tokens


async def through_gateway(session, url: str, body: dict) -> tuple[float, int]:
    """(latency, tokens) of one request through the gateway."""
    start = time.perf_counter()
    tokens = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return time.perf_counter() - start, tokens


async def measure(triton_url: str, gateway: GatewayProcess, concurrency: list[int],
                  rounds: int, max_tokens: int) -> None:
    import aiohttp

    messages = [{"role": "user", "content": PROMPT}]
    request = ChatCompletionRequest("ensemble", messages, max_tokens=max_tokens,
                                    temperature=0.0, stream=True, include_usage=True)
    body = {"model": "ensemble", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    upstream = Upstream(triton_url)
    served = (await upstream.discover())["ensemble"]
    pid = gateway.process.pid
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        # Warm-up: both paths once.
        await direct(upstream, served, request)
        await through_gateway(session, gateway.url, body)
        for level in concurrency:
            runs: dict[str, list[tuple[float, int]]] = {"direct": [], "gateway": []}
            added = []  # per round: the gateway batch's median latency minus the direct one's
            gateway_cpu = client_cpu = 0.0
            for n in range(rounds):
                order = ("direct", "gateway") if n % 2 == 0 else ("gateway", "direct")
                medians = {}
                for way in order:
                    if way == "direct":
                        batch = [direct(upstream, served, request) for _ in range(level)]
                        before = time.process_time()
                    else:
                        batch = [through_gateway(session, gateway.url, body)
                                 for _ in range(level)]
                        before = cpu_seconds(pid)
                    done = await asyncio.gather(*batch)
                    if way == "direct":
                        client_cpu += time.process_time() - before
                    else:
                        gateway_cpu += cpu_seconds(pid) - before
                    runs[way] += done
                    medians[way] = statistics.median(t for t, _ in done)
                added.append(medians["gateway"] - medians["direct"])
            tokens = {t for way in runs.values() for _, t in way}
            assert len(tokens) == 1, f"answers of different lengths: {sorted(tokens)}"
            per = tokens.pop()
            a = statistics.median(t for t, _ in runs["direct"])
            b = statistics.median(t for t, _ in runs["gateway"])
            delivered = per * len(runs["gateway"])
            print(f"concurrency {level}: {len(runs['direct'])} requests each way, {per} tokens "
                  f"each; median latency direct {a:.3f} s, through the gateway {b:.3f} s "
                  f"(ratio {b / a:.3f}); added per token (median of the rounds' differences) "
                  f"{1000 * statistics.median(added) / per:+.3f} ms; CPU per token: the gateway "
                  f"process {1000 * gateway_cpu / delivered:.3f} ms, the direct asyncio gRPC "
                  f"client {1000 * client_cpu / delivered:.3f} ms", flush=True)
    await upstream.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="alternating rounds per level (each: one batch of each way)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8")
    args = parser.parse_args()
    levels = [int(v) for v in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="qvl-bench-gateway-") as tmp:
        root = args.work_dir or Path(tmp)
        repo = build_tiny_reference_repo(root)
        with TritonServer(ServerOptions(repo.path, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            opts = GatewayOptions(server.grpc_url, port=free_ports().http)
            with GatewayProcess(opts, log_file=root / "gateway.log") as gateway:
                gateway.wait_ready()
                asyncio.run(measure(server.grpc_url, gateway, levels, args.rounds,
                                    args.max_tokens))


if __name__ == "__main__":
    main()
