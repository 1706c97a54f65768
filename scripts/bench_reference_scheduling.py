"""Measure the reference tensorrt_llm model's scheduling on a real tritonserver: the latency of
an 8-token request alone, then right after a streamed 1,200-token request was cancelled
(the bound: at most twice the solo time), and the iterations the decoder made after the
cancel (the stock backend's iteration counter, which the reference publishes): a cancelled
stream must stop generating.

It builds what tests/conftest.py builds (the tiny checkpoint, its converted LLM, the
reference-flavor repository) with the tests' small profile widened to 2,048 positions, so
the long request fits.

Usage: python scripts/bench_reference_scheduling.py [--work-dir DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from qvl_trt.client.generate import GenerateClient, GenerateRequest
from qvl_trt.serve.progress import iterations, read_metrics
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo
from qvl_trt.triton import contract as c

LONG_TOKENS = 1200
SHORT_TOKENS = 8
READ_BEFORE_CANCEL = 20  # responses of the long stream read before cancelling it


def short_latency(url: str) -> float:
    with GenerateClient(url) as client:
        start = time.perf_counter()
        generation = client.generate(GenerateRequest("Count to eight.",
                                                     max_tokens=SHORT_TOKENS))
        assert generation.completion_tokens >= 1
        return time.perf_counter() - start


def cancelled_long_stream(url: str) -> None:
    """Read the first responses of a 1,200-token stream, then cancel it (gRPC stream closed
    with its requests cancelled, as a client that goes away). Through tensorrt_llm_bls, the
    cancellable entry point: Triton's ensemble scheduler does not pass a cancel to a step
    that is already running (docs/triton.md, "Cancelling a request")."""
    client = GenerateClient(url, model=c.TENSORRT_LLM_BLS)
    responses = client.stream(GenerateRequest("Tell a long story.", max_tokens=LONG_TOKENS))
    for n, _ in enumerate(responses, 1):
        if n == READ_BEFORE_CANCEL:
            break
    client.grpc_client().stop_stream(cancel_requests=True)
    client.close()


def iterations_made(server: TritonServer) -> float:
    samples = read_metrics(server.metrics_url, timeout_s=10)
    assert samples is not None, "the metrics page does not answer"
    return iterations(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qvl-bench-sched-") as tmp:
        root = args.work_dir or Path(tmp)
        repo = build_tiny_reference_repo(root, max_seq_len=2048, max_num_tokens=2048)
        with TritonServer(ServerOptions(repo.path, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            url = f"grpc://{server.grpc_url}"
            short_latency(url)  # warm-up
            solo = statistics.median(short_latency(url) for _ in range(args.runs))
            after, leaked = [], []
            for _ in range(args.runs):
                cancelled_long_stream(url)
                after.append(short_latency(url))
                before = iterations_made(server)
                time.sleep(1.0)  # a decoder still running the cancelled stream shows here
                leaked.append(iterations_made(server) - before)
            worst = max(after)
            print(f"8-token request alone: {solo:.3f} s (median of {args.runs})")
            print(f"8-token request after a cancelled {LONG_TOKENS}-token stream: "
                  f"{', '.join(f'{t:.3f}' for t in after)} s")
            print(f"ratio (worst / solo): {worst / solo:.2f} (bound: <= 2)")
            print(f"iterations made in the second after each 8-token request: "
                  f"{', '.join(f'{n:.0f}' for n in leaked)} (the cancelled stream stopped: 0)")


if __name__ == "__main__":
    main()
