"""The gateway's answer cache on skewed traffic: a replay of chat requests whose questions are
drawn from a fixed set with Zipf weights (a few asked often, most rarely: what a public
assistant or an FAQ bot sees), sent one after another through the gateway with the openai
package: greedy (temperature 0), a third of the questions about a picture.

tensorrt_llm is the benchmark's token generator (qvl_trt.testing.token_generator, as in
scripts/bench_gateway.py): tokens at a fixed rate, like an engine on a GPU, so that a miss
costs what generating costs there rather than the tiny random model decoding on this
machine's cores. The generator repeats the prompt's text ids (the end token and one-token
stop words left out) until max_tokens, and an answer cut there is never kept: so each request
also sends the stop string "<|im_start|>assistant" (two tokens, which the generator repeats
at the end of the prompt), which ends the answer after one pass over the prompt with
finish_reason "stop", where a real model's end token would end it.

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
       [--zipf S] [--max-tokens T] [--rate TOKENS_PER_S] [--seed SEED]
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

from qvl_trt.serve.progress import read_metrics, total
from qvl_trt.testing.tiny_repository import served_generator
from qvl_trt.triton import contract as c

STOP = "<|im_start|>assistant"  # ends the generator's answer (see the module doc)
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
    # Warm-up, kept out of the cache and the figures: the first text and the first picture
    # request of a fresh server load what later ones reuse.
    warm_up = [[{"role": "user", "content": "Hello."}], [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture(-1)}},
        {"type": "text", "text": "Hello."}]}]]
    for chat in warm_up:
        api.chat.completions.create(model=c.ENSEMBLE, messages=chat, max_tokens=max_tokens,
                                    temperature=0, stop=STOP, extra_body={"answer_cache": False})
    seconds: dict[str, list[float]] = {"hit": [], "miss": [], "bypass": []}
    cut = 0
    for n in order:
        sent = time.perf_counter()
        raw = api.chat.completions.with_raw_response.create(
            model=c.ENSEMBLE, messages=chats[n], max_tokens=max_tokens, temperature=0,
            stop=STOP)
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
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rate", type=float, default=250.0,
                        help="tokens/s the generator makes")
    parser.add_argument("--seed", type=int, default=0, help="of the replay's order")
    args = parser.parse_args()
    order = zipf_replay(args.requests, args.questions, args.zipf, args.seed)
    chats = questions(args.questions)
    with tempfile.TemporaryDirectory(prefix="qvl-bench-answer-cache-") as tmp:
        root = args.work_dir or Path(tmp)
        with served_generator(root, streams=1, tokens=args.max_tokens,
                              tokens_per_s=args.rate) as (_, gateway):
            result = replay(gateway.url, order, chats, args.max_tokens)
            samples = read_metrics(f"{gateway.url}/metrics", timeout_s=10)
    seconds = result["seconds"]
    hits, misses = seconds["hit"], seconds["miss"]
    counted = total(samples, "qvl_gateway_answer_cache_lookups_total", result="hit")
    assert counted == len(hits), (counted, len(hits))
    print(f"{args.requests} requests over {args.questions} questions (Zipf s={args.zipf:g}, "
          f"{len(set(order))} distinct asked: {args.requests - len(set(order))} repeats), "
          f"max_tokens {args.max_tokens}, greedy, stop {STOP!r}, generator {args.rate:g} "
          "tokens/s")
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
