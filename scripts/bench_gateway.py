"""The OpenAI gateway's per-token overhead: the same streamed chat requests sent to Triton
directly (tritonclient's asyncio gRPC client on tensorrt_llm_bls, exactly as the gateway sends
them: qvl_trt.gateway.upstream) and through the gateway (HTTP POST /v1/chat/completions,
server-sent events read with aiohttp's client), in alternating rounds at each concurrency.

tensorrt_llm is the benchmark's token generator (qvl_trt.testing.token_generator, as in
scripts/bench_pipeline_overhead.py): tokens at a fixed rate per stream, like an engine on a
GPU, so that the gateway's CPU does not slow the tokens' making, as it would with the
reference model decoding on the same cores; what the gateway adds then shows as latency.

Per concurrency level it prints, direct and through the gateway: the median time to the first
token, the median gap between streamed pieces and the median request latency; what the
gateway adds per token (end to end: the median over rounds of the difference between the two
batches' median latencies, over the tokens of a request; and to the gap between pieces, the
steady state) and to the first token; and CPU time per token delivered: the gateway's (from
/proc: what it costs a machine whatever else runs) and, for scale, the direct path's client's
(the same asyncio gRPC client the gateway holds). Where the generator's rate times the
streams saturates the machine's cores, the gateway's CPU shows as latency too: --rate sets
what an engine would deliver per stream (e.g. 25 tokens/s at 64 streams).

It builds what tests/conftest.py builds (the tiny checkpoint, its converted LLM, the
reference-flavor repository), serves it with tritonserver and starts the gateway as the child
process `qvl-trt serve --openai-port` starts.

Usage: python scripts/bench_gateway.py [--work-dir DIR] [--rounds N] [--max-tokens T]
       [--rate TOKENS_PER_S] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from qvl_trt.gateway.openai_api import ChatCompletionRequest
from qvl_trt.gateway.upstream import Upstream
from qvl_trt.serve.gateway_process import GatewayProcess
from qvl_trt.testing.tiny_repository import served_generator

PROMPT = "Tell me a long story."
WAYS = ("direct", "gateway")


@dataclass(frozen=True)
class Answer:
    sent: float
    arrivals: tuple[float, ...]  # perf_counter of each piece that carried text
    tokens: int

    @property
    def latency(self) -> float:
        return self.arrivals[-1] - self.sent

    @property
    def first(self) -> float:
        return self.arrivals[0] - self.sent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct(upstream: Upstream, build, request: ChatCompletionRequest) -> Answer:
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async for piece in upstream.generate(build, request):
        if piece.text:
            arrivals.append(time.perf_counter())
        tokens = piece.completion_tokens
    return Answer(sent, tuple(arrivals), tokens)


async def through_gateway(session, url: str, body: dict) -> Answer:
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    return Answer(sent, tuple(arrivals), tokens)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


async def measure(triton_url: str, gateway: GatewayProcess, concurrency: list[int],
                  rounds: int, max_tokens: int) -> None:
    import aiohttp

    messages = [{"role": "user", "content": PROMPT}]
    request = ChatCompletionRequest("ensemble", messages, max_tokens=max_tokens,
                                    temperature=0.0, stream=True, include_usage=True)
    body = {"model": "ensemble", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    upstream = Upstream(triton_url)
    build = (await upstream.discover())["ensemble"].builds[0]
    pid = gateway.process.pid
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        # Warm-up: both paths once.
        await direct(upstream, build, request)
        await through_gateway(session, gateway.url, body)
        for level in concurrency:
            runs: dict[str, list[Answer]] = {way: [] for way in WAYS}
            added = []  # per round: the gateway batch's median latency minus the direct one's
            gateway_cpu = client_cpu = 0.0
            for n in range(rounds):
                medians = {}
                for way in WAYS if n % 2 == 0 else WAYS[::-1]:
                    if way == "direct":
                        batch = [direct(upstream, build, request) for _ in range(level)]
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
                    medians[way] = statistics.median(a.latency for a in done)
                added.append(medians["gateway"] - medians["direct"])
            tokens = {a.tokens for way in runs.values() for a in way}
            assert len(tokens) == 1, f"answers of different lengths: {sorted(tokens)}"
            per = tokens.pop()
            delivered = per * len(runs["gateway"])
            stats = {way: (statistics.median(a.first for a in runs[way]),
                           statistics.median(b - a for x in runs[way]
                                             for a, b in pairwise(x.arrivals)),
                           statistics.median(a.latency for a in runs[way])) for way in WAYS}
            print(f"concurrency {level}: {len(runs['direct'])} requests each way, {per} tokens "
                  "each")
            for way in WAYS:
                first, gap, latency = stats[way]
                print(f"  {way:<8} first token {_ms(first)}, between pieces {_ms(gap)}, "
                      f"request {_ms(latency)}")
            print(f"  the gateway adds per token {1e3 * statistics.median(added) / per:+.4f} ms "
                  f"end to end (median of the rounds' differences over {per} tokens), "
                  f"{1e3 * (stats['gateway'][1] - stats['direct'][1]):+.4f} ms between pieces, "
                  f"{1e3 * (stats['gateway'][0] - stats['direct'][0]):+.3f} ms to the first "
                  "token; CPU per token: "
                  f"the gateway process {1e3 * gateway_cpu / delivered:.3f} ms, the direct "
                  f"asyncio gRPC client {1e3 * client_cpu / delivered:.3f} ms", flush=True)
    await upstream.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="alternating rounds per level (each: one batch of each way)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rate", type=float, default=250.0,
                        help="tokens/s per stream the generator makes")
    parser.add_argument("--concurrency", default="1,16,64")
    args = parser.parse_args()
    levels = [int(v) for v in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="qvl-bench-gateway-") as tmp:
        root = args.work_dir or Path(tmp)
        with served_generator(root, streams=max(levels), tokens=args.max_tokens,
                              tokens_per_s=args.rate) as (server, gateway):
            print(f"generator: {args.rate:g} tokens/s per stream; {args.rounds} alternating "
                  "rounds per level (medians)", flush=True)
            asyncio.run(measure(server.grpc_url, gateway, levels, args.rounds, args.max_tokens))


if __name__ == "__main__":
    main()
