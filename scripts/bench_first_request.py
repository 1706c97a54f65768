"""Is the first request after ready cold? `qvl-trt serve` on the tiny reference repository,
started several times with its warm-up (serve/warmup.py) and as many times without it
(`--no-warm-up`), interleaved; after each start has reported ready, the same request (a
question about a 256x256 image, 8 tokens, greedy) is sent N times one after the other.
Each image has its own colour, so that the vision encoder's cache serves none of them: every
request does the same work. Prints, per mode, the first request's latency over the tenth's
and over the median of the rest, each the median over the starts, and checks that with the
warm-up the first is at most BOUND times the tenth (exit code 1 otherwise).

python scripts/bench_first_request.py [--repo REPO] [--starts N] [--requests N]

Without --repo it builds the tiny reference repository in a temporary folder first (a
minute or so).
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "qvl_trt.cli"]
READY_TIMEOUT_S = 600
SIDE = 256
TOKENS = 8
# With the warm-up the first request after ready may be at most this much slower than the
# tenth (the median over the starts): a loaded machine moves single requests by tens of percent.
BOUND = 1.5


def _request(index: int) -> bytes:
    from qvl_trt.serve.warmup import png
    from qvl_trt.triton import contract as c

    colour = (index * 37 % 256, index * 91 % 256, 200)  # never the warm-up image's
    image = base64.b64encode(png(SIDE, SIDE, colour)).decode()
    return json.dumps({c.TEXT_INPUT: "What colour is this?",
                       c.IMAGE_BYTES: [f"data:image/png;base64,{image}"],
                       c.MAX_TOKENS: TOKENS, c.TEMPERATURE: 0.0, c.STREAM: False}).encode()


def _ready(health: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/ready", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def one_start(repo: Path, log: Path, *, warm: bool, requests: int, first_index: int
              ) -> list[float]:
    """Start serve, wait for ready, send the requests; their latencies in seconds."""
    from qvl_trt.serve.server import free_ports
    from qvl_trt.triton import contract as c

    ports, health = free_ports(), free_ports().http
    with open(log, "ab") as out:
        serve = subprocess.Popen(
            [*CLI, "serve", str(repo), "--host", "127.0.0.1", "--http-port", str(ports.http),
             "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
             "--health-port", str(health), *([] if warm else ["--no-warm-up"])],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(health):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not get ready; see {log}")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{ports.http}/v2/models/{c.ENSEMBLE}/generate"
        latencies = []
        for index in range(first_index, first_index + requests):
            body = _request(index)
            began = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(url, data=body),
                                        timeout=300) as reply:
                json.loads(reply.read())
            latencies.append(time.perf_counter() - began)
        return latencies
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, help="A reference-flavor repository [default: "
                        "build the tiny one in a temporary folder].")
    parser.add_argument("--starts", type=int, default=3, help="Server starts of each mode.")
    parser.add_argument("--requests", type=int, default=12,
                        help="Requests after each start (at least 10: the tenth is compared).")
    args = parser.parse_args(argv)
    if args.requests < 10:
        parser.error(f"--requests {args.requests}: send at least 10, the tenth is compared")
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repo
        if repo is None:
            from qvl_trt.testing.tiny_repository import build_tiny_reference_repo

            print("building the tiny reference repository ...", flush=True)
            repo = build_tiny_reference_repo(Path(tmp) / "tiny").path
        runs: dict[str, list[list[float]]] = {"warm-up on": [], "warm-up off": []}
        index = 0
        for start in range(args.starts):
            # interleaved, the order alternating: load on the machine hits both alike
            order = list(runs) if start % 2 == 0 else list(reversed(runs))
            for mode in order:
                latencies = one_start(repo, Path(tmp) / "serve.log", warm=mode == "warm-up on",
                                      requests=args.requests, first_index=index)
                index += args.requests
                runs[mode].append(latencies)
                print(f"  start {start + 1} {mode}: first {latencies[0] * 1000:.0f} ms, "
                      f"tenth {latencies[9] * 1000:.0f} ms", flush=True)
    print(f"{args.starts} starts each way, {args.requests} requests after each ready "
          f"({SIDE}x{SIDE} image, {TOKENS} tokens); medians over the starts:")
    tenths = {}
    for mode, starts in runs.items():
        tenths[mode] = statistics.median(r[0] / r[9] for r in starts)
        rest = statistics.median(r[0] / statistics.median(r[1:]) for r in starts)
        first = statistics.median(r[0] for r in starts) * 1000
        print(f"  {mode:12s} first/tenth {tenths[mode]:5.2f}x  first/median of the rest "
              f"{rest:5.2f}x  (first {first:.0f} ms)")
    ok = tenths["warm-up on"] <= BOUND
    print(f"{'PASS' if ok else 'FAIL'}: with the warm-up the first request is "
          f"{tenths['warm-up on']:.2f}x the tenth (bound {BOUND:g}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
