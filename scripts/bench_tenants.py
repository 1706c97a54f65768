"""Two tenants behind one gateway: tenant A floods it past its quota while tenant B sends a
fixed sequence of chat requests; B's latency with A flooding over B's latency with A idle, in
alternating rounds, A's 429 count, and whether B's answers stay the same.

The gateway holds --slots slots (--max-concurrency) and as many waiting places; A's keys-file
quota is --a-streams requests in flight (max_streams) and B has none. In a flood round, A's
--flooders clients send streamed requests back to back (a 429 is counted and sent again after
10 ms, as a client that ignores Retry-After would), and once A holds its quota B sends
--b-requests requests, --b-concurrency at a time; an idle round is B's sequence alone. B's
answers must be equal in every round (the gateway prints a mismatch and exits 1).

tensorrt_llm is the benchmark's token generator (qvl_trt.testing.token_generator, as in
scripts/bench_gateway.py): tokens at a fixed rate per stream, like an engine on a GPU, so the
CPU a flood costs the gateway shows as latency rather than slowing the tokens' making.

Usage: python scripts/bench_tenants.py [--work-dir DIR] [--rounds N] [--slots S]
       [--a-streams N] [--flooders N] [--b-requests N] [--b-concurrency N]
       [--max-tokens T] [--rate TOKENS_PER_S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from qvl_trt.gateway import metrics as gm
from qvl_trt.gateway.tenants import Quotas, add_key
from qvl_trt.serve.progress import read_metrics, total
from qvl_trt.testing.tiny_repository import served_generator

B_PROMPTS = [f"Question {i}: tell me about the sea." for i in range(8)]
A_PROMPT = "Tell me a long story."


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": "ensemble", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def ask(session, url: str, key: str, payload: dict) -> tuple[int, float, str]:
    """(HTTP status, seconds to the last byte, the streamed text)."""
    sent, parts = time.perf_counter(), []
    async with session.post(f"{url}/v1/chat/completions", json=payload,
                            headers={"Authorization": f"Bearer {key}"}) as reply:
        if reply.status != 200:
            await reply.read()
            return reply.status, time.perf_counter() - sent, ""
        async for line in reply.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return 200, time.perf_counter() - sent, "".join(parts)


async def b_sequence(session, url: str, key: str, n: int, concurrency: int,
                     max_tokens: int) -> list[tuple[float, str]]:
    """B's requests, `concurrency` at a time, in their order: (latency, text) each."""
    out: list[tuple[float, str]] = []
    for start in range(0, n, concurrency):
        batch = [ask(session, url, key, body(B_PROMPTS[i % len(B_PROMPTS)], max_tokens))
                 for i in range(start, min(n, start + concurrency))]
        for status, latency, text in await asyncio.gather(*batch):
            if status != 200:
                raise SystemExit(f"tenant B got HTTP {status}: its requests must never be "
                                 "refused")
            out.append((latency, text))
    return out


async def flooder(session, url: str, key: str, payload: dict, stop: asyncio.Event,
                  counts: dict[str, int]) -> None:
    """Tenant A's client: requests back to back until `stop`, a 429 sent again after 10 ms."""
    while not stop.is_set():
        status, _, _ = await ask(session, url, key, payload)
        counts["sent"] += 1
        if status == 429:
            counts["429"] += 1
            await asyncio.sleep(0.01)


async def measure(args, url: str, keys: dict[str, str]) -> int:
    import aiohttp

    def in_flight() -> float:
        return total(read_metrics(f"{url}/metrics", timeout_s=10) or {}, gm.IN_FLIGHT)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        reference = [t for _, t in await b_sequence(session, url, keys["B"], args.b_requests,
                                                    args.b_concurrency, args.max_tokens)]
        medians = {"idle": [], "flood": []}
        refused = sent = 0
        for n in range(args.rounds):
            for way in ("idle", "flood") if n % 2 == 0 else ("flood", "idle"):
                stop, counts = asyncio.Event(), {"429": 0, "sent": 0}
                flood = [asyncio.create_task(flooder(session, url, keys["A"],
                                                     body(A_PROMPT, args.max_tokens), stop,
                                                     counts))
                         for _ in range(args.flooders)] if way == "flood" else []
                while flood and in_flight() < args.a_streams:
                    await asyncio.sleep(0.05)  # A holds its whole quota before B starts
                done = await b_sequence(session, url, keys["B"], args.b_requests,
                                        args.b_concurrency, args.max_tokens)
                stop.set()
                await asyncio.gather(*flood)
                if [t for _, t in done] != reference:
                    print(f"round {n} ({way}): tenant B's answers differ from its first ones")
                    return 1
                medians[way].append(statistics.median(latency for latency, _ in done))
                refused += counts["429"]
                sent += counts["sent"]
        ratios = [f / i for f, i in zip(medians["flood"], medians["idle"], strict=True)]
        print(f"tenant B's median latency per round, A idle: "
              f"{', '.join(f'{m * 1e3:.1f}' for m in medians['idle'])} ms; A flooding: "
              f"{', '.join(f'{m * 1e3:.1f}' for m in medians['flood'])} ms")
        print(f"tenant B latency ratio (A flooding / A idle): median "
              f"{statistics.median(ratios):.3f} over {args.rounds} rounds (each "
              f"{min(ratios):.3f} to {max(ratios):.3f}); B's answers identical in every round")
        print(f"tenant A: {refused} of its {sent} requests got 429 (max_streams "
              f"{args.a_streams})")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--slots", type=int, default=8, help="the gateway's --max-concurrency")
    parser.add_argument("--a-streams", type=int, default=4, help="tenant A's max_streams")
    parser.add_argument("--flooders", type=int, default=16, help="tenant A's clients")
    parser.add_argument("--b-requests", type=int, default=8)
    parser.add_argument("--b-concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0,
                        help="tokens/s per stream the generator makes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qvl-bench-tenants-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        keys_file = root / "keys.json"
        keys = {"A": add_key(keys_file, "tenant-a", Quotas(max_streams=args.a_streams))[0],
                "B": add_key(keys_file, "tenant-b")[0]}
        with served_generator(root, streams=args.slots, tokens=args.max_tokens,
                              tokens_per_s=args.rate, max_concurrency=args.slots,
                              max_queue=args.slots, keys_file=keys_file) as (_, gateway):
            print(f"generator: {args.rate:g} tokens/s per stream, {args.max_tokens} tokens "
                  f"an answer; gateway slots {args.slots}; tenant A: {args.flooders} "
                  f"clients, max_streams {args.a_streams}; tenant B: {args.b_requests} "
                  f"requests, {args.b_concurrency} at a time; {args.rounds} alternating "
                  "rounds", flush=True)
            raise SystemExit(asyncio.run(measure(args, gateway.url, keys)))


if __name__ == "__main__":
    main()
