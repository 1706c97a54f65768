"""The gateway's answer cache on skewed traffic: a replay of chat requests whose questions are
drawn from a fixed set with Zipf weights (a few asked often, most rarely: what a public
assistant or an FAQ bot sees), sent one after another through the gateway with the openai
package, as a client that wants reproducible answers sends them: sampled from a fixed seed,
one sentence asked for (stop at the first "\\n", ".", "!" or "?": with seeded sampling these
end most of the tiny random model's answers by themselves, as a real model's end token
would; its greedy answers repeat one token up to max_tokens, and an answer cut there is never
kept), a third of the questions about a picture.

Hits and misses come interleaved in the same replay, so each latency has its baseline measured
beside it: it prints the hit rate (from the gateway's x-qvl-cache header, checked against its
qvl_gateway_answer_cache_lookups counter), the hit and the miss latency percentiles (request
sent to last byte, non-streamed) and the ratio of the medians, how many requests repeat an
earlier question (the hit rate's ceiling) and how many answers the cache could not keep (cut
at max_tokens: a miss each time they are asked).

It builds what tests/conftest.py builds (the tiny checkpoint, its converted LLM, the
reference-flavor repository), serves it with tritonserver and starts the gateway as
`qvl-trt serve --openai-port` does.

Usage: python scripts/bench_answer_cache.py [--work-dir DIR] [--requests N] [--questions Q]
       [--zipf S] [--max-tokens T] [--seed SEED]
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import statistics
import tempfile
import time
from pathlib import Path

from qvl_trt.gateway.options import GatewayOptions
from qvl_trt.serve.gateway_process import GatewayProcess
from qvl_trt.serve.progress import read_metrics, total
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo
from qvl_trt.triton import contract as c

SEED = 1234  # the client's, the same for every request
STOP = ["\n", ".", "!", "?"]
SUBJECTS = ("the weather", "a recipe", "the news", "a poem", "a bus timetable", "a password",
            "a holiday", "a refund", "an invoice", "a delivery")
VERBS = ("Summarise", "Explain", "Translate", "Describe", "Check")


def picture(seed: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (64, 64), tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def questions(count: int) -> list[list[dict]]:
    """`count` distinct single-turn chats, every third about a picture."""
    chats = []
    for i in range(count):
        text = f"{VERBS[i % len(VERBS)]} {SUBJECTS[i // len(VERBS) % len(SUBJECTS)]} ({i})."
        content = [{"type": "image_url", "image_url": {"url": picture(i)}},
                   {"type": "text", "text": text}] if i % 3 == 0 else text
        chats.append([{"role": "user", "content": content}])
    return chats


def zipf_replay(count: int, questions: int, s: float, seed: int) -> list[int]:
    """`count` question numbers drawn with weight 1 / rank^s."""
    weights = [1 / (rank + 1) ** s for rank in range(questions)]
    return random.Random(seed).choices(range(questions), weights, k=count)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay(url: str, order: list[int], chats: list[list[dict]], max_tokens: int) -> dict:
    import openai

    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    seconds: dict[str, list[float]] = {"hit": [], "miss": [], "bypass": []}
    cut = 0
    for n in order:
        sent = time.perf_counter()
        raw = api.chat.completions.with_raw_response.create(
            model=c.ENSEMBLE, messages=chats[n], max_tokens=max_tokens, temperature=1,
            seed=SEED, stop=STOP)
        answer = raw.parse()
        seconds[raw.headers["x-qvl-cache"]].append(time.perf_counter() - sent)
        cut += answer.choices[0].finish_reason == "length"
    return {"seconds": seconds, "cut": cut}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--questions", type=int, default=100, help="distinct questions")
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="of the replay's order (the "
                        "requests' own seed is fixed)")
    args = parser.parse_args()
    order = zipf_replay(args.requests, args.questions, args.zipf, args.seed)
    chats = questions(args.questions)
    with tempfile.TemporaryDirectory(prefix="qvl-bench-answer-cache-") as tmp:
        root = args.work_dir or Path(tmp)
        repo = build_tiny_reference_repo(root)
        with TritonServer(ServerOptions(repo.path, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            opts = GatewayOptions(server.grpc_url, port=free_ports().http)
            with GatewayProcess(opts, log_file=root / "gateway.log") as gateway:
                gateway.wait_ready()
                result = replay(gateway.url, order, chats, args.max_tokens)
                samples = read_metrics(f"{gateway.url}/metrics", timeout_s=10)
    seconds = result["seconds"]
    hits, misses = seconds["hit"], seconds["miss"]
    counted = total(samples, "qvl_gateway_answer_cache_lookups_total", result="hit")
    assert counted == len(hits), (counted, len(hits))
    print(f"{args.requests} requests over {args.questions} questions (Zipf s={args.zipf:g}, "
          f"{len(set(order))} distinct asked: {args.requests - len(set(order))} repeats), "
          f"max_tokens {args.max_tokens}, seed {SEED}, stop {STOP}")
    print(f"hit rate {len(hits) / args.requests:.1%} ({len(hits)} hits, {len(misses)} misses, "
          f"{len(seconds['bypass'])} bypasses; {result['cut']} answers cut at max_tokens, "
          "which are not kept)")
    for name, values in (("hit", hits), ("miss", misses)):
        if values:
            print(f"{name:4} latency ms: " + "  ".join(
                f"p{round(100 * q)} {1e3 * percentile(values, q):.2f}" for q in (0.5, 0.9, 0.99)))
    if hits and misses:
        ratio = statistics.median(misses) / statistics.median(hits)
        print(f"miss/hit median latency ratio {ratio:.1f}x")


if __name__ == "__main__":
    main()
