"""Saturation: at 1x, 2x and 5x a build's batch slots, that many clients at once each stream a
long answer (ignore_eos, as genai-perf and AIPerf load a server) through the OpenAI endpoint
of `qvl-trt serve`. Per level it prints the output token throughput, p50/p99 time to first
token and queue wait, the errors and the server restarts, and the throughput as a ratio of
the 1x level's, measured in the same run (levels interleaved when --rounds > 1).
With --hang-up-every K every K-th client closes its stream after the first piece of text, as
a user who stops reading does: the gateway must count each as a client-closed request (499)
and the server free its slot for those waiting; the level's figures are the other clients'.

By default it builds the tiny random checkpoint for a shipped profile (--gpu, 4090d: 12
batch slots), writes its reference repository and serves it with `qvl-trt serve
--openai-port` (supervisor, gateway, readiness). With --repo it serves that repository
instead: a trt repository in the serving image on its GPU measures the product the same way.
The default queue admits 5x the slots, so every level should end with 0 errors and 0
restarts; queue wait and TTFT grow with the level while throughput stays level.

Queue wait is the server's own: the histogram qvl_llm_queue_wait_seconds (its buckets'
increase over a level, quantiles interpolated within a bucket as Prometheus'
histogram_quantile does). TTFT is the client's, from the request sent to the first piece of
text. The reference flavor decodes on this machine's cores beside the clients; its figures
say what the serving path does under saturation, not what a GPU engine delivers.

Usage: python scripts/bench_saturation.py [--gpu 4090d] [--multiples 1,2,5]
       [--max-tokens 1000] [--rounds 1] [--work-dir DIR] [--repo REPO] [--model NAME]
       [--hang-up-every K] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from qvl_trt.child import kill_group, popen_owned, signals_held
from qvl_trt.client.metrics import RequestRecord, level_metrics
from qvl_trt.gateway import metrics as gm
from qvl_trt.gateway.readiness import ready_state
from qvl_trt.serve.progress import Samples, read_metrics, total
from qvl_trt.serve.server import free_ports
from qvl_trt.triton import contract as c
from qvl_trt.triton.pbconfig import CONFIG_FILE, parameters, parse_config

WAIT_BUCKETS = "qvl_llm_queue_wait_seconds_bucket"


def build_repo(root: Path, gpu: str, dims: str = "") -> Path:
    """The tiny checkpoint's reference repository for a shipped profile; `dims` overrides
    the checkpoint's sizes (make_tiny_checkpoint.py --dims)."""
    from qvl_trt.build import BuildOptions, Stage, run_build
    from qvl_trt.testing.tiny_checkpoint import parse_dims, write_tiny_checkpoint
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    ckpt = write_tiny_checkpoint(root / "ckpt", dims=parse_dims(dims))
    run_build(BuildOptions(model=str(ckpt), gpu=gpu), root / "build",
              only=(Stage.LLM_CHECKPOINT,))
    return write_repo([BuildInput(root / "build")], root / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE)).path


def batch_slots(repo: Path) -> int:
    """The batch slots of the repository's tensorrt_llm_bls model; of several (one
    checkpoint's chat and video builds), the most: the gateway sends text to the build of the
    higher batch (gateway/routing.py)."""
    slots = []
    for path in sorted(repo.glob(f"*/{CONFIG_FILE}")):
        caller = c.llm_caller_parameters(parameters(parse_config(path.read_text(), str(path))),
                                         str(path))
        if isinstance(caller, c.TensorrtLlmBlsParameters):
            slots.append(caller.batch_slots)
    if not slots:
        raise SystemExit(f"{repo} has no tensorrt_llm_bls model")
    return max(slots)


class Served:
    """`qvl-trt serve REPO --openai-port` on free ports, with its readiness port. It never
    outlives this script (popen_owned: its own process group, killed with it), so a Ctrl-C
    reaches only the script, whose `stop` then ends it cleanly."""

    def __init__(self, repo: Path, log: Path) -> None:
        self.ports, self.health, self.openai = free_ports(), free_ports().http, free_ports().http
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        with signals_held():
            self.process = popen_owned(
                [sys.executable, "-m", "qvl_trt.cli", "serve", str(repo), "--host", "127.0.0.1",
                 "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
                 "--metrics-port", str(self.ports.metrics), "--health-port", str(self.health),
                 "--openai-port", str(self.openai)], stdout=self.log, stderr=subprocess.STDOUT)

    def state(self) -> dict | None:
        return ready_state(f"http://127.0.0.1:{self.health}/ready", 30)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not ((state := self.state()) and state["ready"]):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not get ready ({state}); see {self.log.name}")
            time.sleep(0.5)
        gateway = f"http://127.0.0.1:{self.openai}/ready"
        while True:  # the gateway forwards serve's readiness once it found the builds
            try:
                with urllib.request.urlopen(gateway, timeout=30):
                    return
            except OSError:
                time.sleep(0.5)

    def metrics(self, port: int | None = None) -> Samples:
        """Triton's metrics, or those of the server on `port` (the gateway's)."""
        url = f"http://127.0.0.1:{port or self.ports.metrics}/metrics"
        samples = read_metrics(url, timeout_s=30)
        if samples is None:
            raise SystemExit(f"the metrics at {url} do not answer; see {self.log.name}")
        return samples

    def client_closed(self) -> float:
        """Requests the gateway counted as closed by their client (499)."""
        return total(self.metrics(self.openai), "qvl_gateway_requests_total",
                     status=str(gm.CLIENT_CLOSED))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_group(self.process.pid)
            self.process.wait()
        self.log.close()


def wait_buckets(samples: Samples) -> dict[float, float]:
    """The queue wait histogram's cumulative buckets (upper bound -> count), summed over the
    callers' instances."""
    bounds = {dict(labels)["le"] for name, labels in samples if name == WAIT_BUCKETS}
    return {float(le): total(samples, WAIT_BUCKETS, le=le) for le in bounds}


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over the buckets' increase between two readings."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    n = counts[-1][1] if counts else 0.0
    if n <= 0:
        return math.nan
    rank, lower, below = q * n, 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


async def stream(api, model: str, max_tokens: int, n: int, hang_up: bool = False
                 ) -> RequestRecord | None:
    """One client's answer, measured; None for a client that hung up after its first piece."""
    import openai

    sent, first, usage = time.perf_counter(), None, None
    try:
        chunks = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
                if hang_up:
                    await chunks.close()
                    return None
            usage = chunk.usage or usage
        return RequestRecord(sent, first, time.perf_counter(),
                             output_tokens=usage.completion_tokens if usage else 0)
    except openai.OpenAIError as exc:
        return RequestRecord(sent, first, time.perf_counter(), error=f"{type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}")


async def level(served: Served, clients: int, max_tokens: int, model: str = c.ENSEMBLE,
                hang_up_every: int = 0) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{served.openai}/v1",
                             api_key="unused", max_retries=0, timeout=24 * 3600)
    restarts, before = served.state()["restarts"], wait_buckets(served.metrics())
    closed = served.client_closed()
    try:
        answers = await asyncio.gather(*(stream(
            api, model, max_tokens, n, hang_up_every > 0 and n % hang_up_every == 0)
            for n in range(clients)))
    finally:
        await api.close()
    after, state = wait_buckets(served.metrics()), served.state()
    records = [r for r in answers if r is not None]
    m = level_metrics(len(records), records)
    ttft = m.metrics["time_to_first_token"]
    return {
        "clients": clients, "errors": m.errors, "restarts": state["restarts"] - restarts,
        "ready_after": state["ready"], "output_tokens_per_s": m.output_token_throughput,
        "ttft_p50_s": ttft.p50 / 1000 if ttft else math.nan,
        "ttft_p99_s": ttft.p99 / 1000 if ttft else math.nan,
        "queue_wait_p50_s": quantile(0.5, before, after),
        "queue_wait_p99_s": quantile(0.99, before, after),
        "duration_s": m.duration_s,
        "first_errors": sorted({r.error for r in records if r.error})[:3],
        "hung_up": len(answers) - len(records),
        "client_closed": served.client_closed() - closed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="4090d", help="shipped profile of the tiny build")
    parser.add_argument("--repo", type=Path, help="serve this repository instead")
    parser.add_argument("--multiples", default="1,2,5", help="clients per level, in slots")
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--model", default=c.ENSEMBLE,
                        help="OpenAI model asked: a one-build repository's ensemble, or the "
                        "checkpoint's name that its builds (chat and video) are served as")
    parser.add_argument("--hang-up-every", type=int, default=0, metavar="K",
                        help="every K-th client closes its stream after the first piece "
                        "(0: none)")
    parser.add_argument("--json", type=Path, help="also write the levels here")
    args = parser.parse_args()
    multiples = [int(m) for m in args.multiples.split(",")]
    with tempfile.TemporaryDirectory(prefix="qvl-bench-sat-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        repo = args.repo or build_repo(root, args.gpu)
        slots = batch_slots(repo)
        served = Served(repo, root / "serve.log")
        try:
            served.wait_ready()
            asyncio.run(level(served, slots, 8, args.model))  # warm-up: kernels, caches
            results = []
            for _ in range(args.rounds):
                for multiple in multiples:
                    results.append({"multiple": multiple, **asyncio.run(
                        level(served, multiple * slots, args.max_tokens, args.model,
                              args.hang_up_every))})
                    print(json.dumps(results[-1]), flush=True)
        finally:
            served.stop()
    base = [r["output_tokens_per_s"] for r in results if r["multiple"] == multiples[0]]
    baseline = sum(base) / len(base)
    if not baseline:  # every baseline request failed: no ratio means anything
        errors = sum(r["errors"] for r in results if r["multiple"] == multiples[0])
        raise SystemExit(f"bench_saturation: the {multiples[0]}x level produced no tokens "
                         f"({errors} errors); give --model a name the gateway's /v1/models "
                         "lists")
    print(f"\n{slots} batch slots, {args.max_tokens}-token answers (ignore_eos), "
          f"{args.rounds} round(s)")
    print(f"{'level':>6} {'clients':>7} {'tokens/s':>9} {'ratio':>6} {'TTFT p50':>9} "
          f"{'p99':>7} {'wait p50':>9} {'p99':>7} {'errors':>6} {'restarts':>8} "
          f"{'hung up':>7} {'499s':>5}")
    for r in results:
        print(f"{r['multiple']:>5}x {r['clients']:>7} {r['output_tokens_per_s']:>9.1f} "
              f"{r['output_tokens_per_s'] / baseline:>6.2f} {r['ttft_p50_s']:>8.1f}s "
              f"{r['ttft_p99_s']:>6.1f}s {r['queue_wait_p50_s']:>8.1f}s "
              f"{r['queue_wait_p99_s']:>6.1f}s {r['errors']:>6} {r['restarts']:>8} "
              f"{r['hung_up']:>7} {r['client_closed']:>5.0f}")
    if args.json:
        args.json.write_text(json.dumps({"slots": slots, "max_tokens": args.max_tokens,
                                         "levels": results}, indent=2))


if __name__ == "__main__":
    main()
