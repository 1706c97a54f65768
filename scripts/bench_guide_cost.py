"""What a structured-output guide costs the other requests of a step.

1. Per token (default): the compile of schemas at the gateway's bounds, then xgrammar's
   token-mask fill (the installed version, printed), the work the stock executor (and
   the reference tensorrt_llm) does on the step's thread for every guided request at every
   token, with Qwen's 151k-token vocabulary, for schema shapes a client may send. Each shape
   is walked through a string value one character at a time (--tokens of them) and the fills
   timed; printed with whether the gateway admits the shape (llm/schema_subset.py) and
   as a ratio of the unbounded string's cost, measured in the same run, interleaved.
2. Served (--served): the tiny checkpoint's reference repository behind `qvl-trt serve
   --openai-port`; a plain stream of --max-tokens tokens (ignore_eos) is timed beside
   --guided streams guided by the costliest schema the gateway admits, and beside as many
   unguided streams of --max-tokens tokens (the same load without guides), in alternating
   rounds; prints each round and the ratio guided/unguided: what the guides themselves cost
   another client's tokens.

Usage: python scripts/bench_guide_cost.py [--tokens 8] [--rounds 3]
       [--served [--guided 4] [--max-tokens 200] [--gpu 4090d] [--work-dir DIR]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

# Shapes of a string property "k" (the value walked), the first the baseline.
SHAPES = {
    "unbounded string": {"type": "string"},
    "enum of 1000": {"type": "string", "enum": [f"v{i}" for i in range(1000)]},
    "maxLength 4": {"type": "string", "maxLength": 4},
    "maxLength 8": {"type": "string", "maxLength": 8},
    "maxLength 16": {"type": "string", "maxLength": 16},
    "maxLength 400": {"type": "string", "maxLength": 400},
    "pattern [a-z]{0,400}": {"type": "string", "pattern": "^[a-z]{0,400}$"},
    "pattern [a-z]{0,4}": {"type": "string", "pattern": "^[a-z]{0,4}$"},
    "pattern [^x]{0,400}": {"type": "string", "pattern": "^[^x]{0,400}$"},
}
# Schemas at and past the gateway's bounds, whose compile the stock executor runs on its
# step's thread once per distinct schema.
def _properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}}
    return schema


COMPILES = {
    "200 optional properties": _properties(200),
    "500 optional properties": _properties(500),
    "enum of 1000": {"enum": [f"value-{i}" for i in range(1000)]},
    "10 levels of objects": _nested(10),
}
# The costliest shape the gateway admits, as the guided streams of --served send it: more
# items than --max-tokens tokens hold, so that they run as long as the unguided ones.
WORST_ADMITTED = {"type": "array", "minItems": 400, "maxItems": 400,
                  "items": {"type": "string", "maxLength": 4}}


def schema_of(shape: dict) -> dict:
    return {"type": "object", "properties": {"k": shape}, "required": ["k"],
            "additionalProperties": False}


def admitted(schema: dict) -> str:
    from qvl_trt.llm.schema_subset import SchemaError, check_schema

    try:
        check_schema(schema)
    except SchemaError:
        return "refused"
    return "admitted"


def mask_costs(tokens: int, rounds: int) -> None:
    from qvl_trt.llm.guided import GuidedDecoding, TokenizerInfo, compact_json_schema
    from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

    xgr = __import__("xgrammar")
    xgrammar_version = metadata.version("xgrammar")
    with tempfile.TemporaryDirectory(prefix="qvl-bench-guide-") as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "ckpt")
        guided = GuidedDecoding(TokenizerInfo.of_tokenizer(ckpt / "tokenizer.json", [151645]),
                                151936)
        compiled = {name: guided.compiler.compile_grammar(
            compact_json_schema(json.dumps(schema_of(shape)))) for name, shape in SHAPES.items()}
        print(f"compile (xgrammar {xgrammar_version}: the gateway's conversion, then the "
              "executor's compile, first time)")
        for name, schema in COMPILES.items():
            start = time.perf_counter()
            grammar = compact_json_schema(json.dumps(schema))
            converted = time.perf_counter()
            guided.compiler.compile_grammar(grammar)
            print(f"{name:<24} {admitted(schema):>8} convert {converted - start:6.2f} s, "
                  f"compile {time.perf_counter() - converted:6.2f} s")
    seconds: dict[str, list[float]] = {name: [] for name in SHAPES}
    for _ in range(rounds):
        for name in SHAPES:  # interleaved: every shape each round
            matcher = xgr.GrammarMatcher(compiled[name])
            mask = xgr.allocate_token_bitmask(1, 151936)
            assert matcher.accept_string('{"k": "')
            for _ in range(tokens):
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                seconds[name].append(time.perf_counter() - start)
                matcher.accept_string("v" if name.startswith("enum") else "a")
    base = statistics.mean(seconds["unbounded string"])
    print(f"token-mask fill, xgrammar {xgrammar_version}, 151936-token vocabulary, "
          f"{tokens} tokens x {rounds} rounds (mean and slowest fill; ratio of the means to "
          "the unbounded string's)")
    print(f"{'shape':<22} {'gateway':>8} {'ms/token':>9} {'max ms':>8} {'ratio':>8}")
    for name, shape in SHAPES.items():
        mean = statistics.mean(seconds[name])
        print(f"{name:<22} {admitted(schema_of(shape)):>8} {mean * 1e3:>9.2f} "
              f"{max(seconds[name]) * 1e3:>8.1f} {mean / base:>8.0f}")


async def _stream(api, max_tokens: int, schema: dict | None) -> float:
    fields: dict = {"extra_body": {"ignore_eos": True}} if schema is None else {
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": schema}}}
    start = time.perf_counter()
    stream = await api.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "Go on."}],
        max_tokens=max_tokens, temperature=1.0, stream=True, **fields)
    async for _ in stream:
        pass
    return time.perf_counter() - start


async def _round(url: str, others: int, max_tokens: int, schema: dict | None) -> float:
    """The plain stream's seconds beside `others` streams (started first) of `schema`."""
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                  timeout=600) as api:
        beside = [asyncio.create_task(_stream(api, max_tokens, schema)) for _ in range(others)]
        await asyncio.sleep(0.5)
        plain = await _stream(api, max_tokens, None)
        await asyncio.gather(*beside)
    return plain


def served(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_saturation import Served, build_repo

    with tempfile.TemporaryDirectory(prefix="qvl-bench-guide-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        server = Served(build_repo(root, args.gpu), root / "serve.log")
        try:
            server.wait_ready()
            url = f"http://127.0.0.1:{server.openai}/v1"
            asyncio.run(_round(url, args.guided, 16, WORST_ADMITTED))  # warm-up: xgrammar
            plain, guided = [], []
            for n in range(args.rounds):
                plain.append(asyncio.run(_round(url, args.guided, args.max_tokens, None)))
                guided.append(asyncio.run(_round(url, args.guided, args.max_tokens,
                                                 WORST_ADMITTED)))
                print(f"round {n + 1}: beside {args.guided} unguided {plain[-1]:.2f} s, "
                      f"beside {args.guided} guided {guided[-1]:.2f} s", flush=True)
        finally:
            server.stop()
    ratio = statistics.median(guided) / statistics.median(plain)
    print(f"a plain {args.max_tokens}-token stream beside {args.guided} streams guided by "
          f"{json.dumps(WORST_ADMITTED)}: {ratio:.2f}x its time beside as many unguided "
          f"{args.max_tokens}-token streams (median of {args.rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8, help="mask fills per shape a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--served", action="store_true", help="measure through a server")
    parser.add_argument("--guided", type=int, default=4, help="guided streams beside")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--gpu", default="4090d", help="shipped profile of the tiny build")
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args()
    served(args) if args.served else mask_costs(args.tokens, args.rounds)


if __name__ == "__main__":
    main()
