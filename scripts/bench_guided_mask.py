"""Measure what guided decoding's token mask costs per generated token in the reference
tensorrt_llm stand-in: the same requests decoded with and without a guide, interleaved, and
the ratio of the two.

It builds what tests/conftest.py builds (the tiny checkpoint, its converted LLM, the
reference-flavor repository) and drives the stand-in's in-flight batch
(llm.reference.DecodeBatch) with the tokenizer info that repository ships: per step each
guided request's matcher accepts its last token, fills its bitmask over the 151,936-token
vocabulary and masks its logits (what batch_manager/guidedDecoder.cpp does in the
executor's loop). Every request generates exactly --tokens tokens: the end token is held
back by min_tokens in both runs, and the guide (a regex over letters and spaces) never
ends; its stop tokens are narrowed to that end token so that no other end token ends it.
The tiny model's step is far cheaper than a real model's, so the ratio is an upper bound of
the mask's share; the difference per token is the mask's own cost.

Usage: python scripts/bench_guided_mask.py [--work-dir DIR] [--rounds N] [--batch B]
       [--tokens T]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.llm.guided import (
    Guide,
    GuidedDecoding,
    GuideType,
    TokenizerInfo,
)
from qvl_trt.llm.reference import ReferenceDecoder
from qvl_trt.llm.sampling import DecodeRequest, SamplingParams
from qvl_trt.mm.rope import mrope_cos_sin_table
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo
from qvl_trt.triton.layout import TOKENIZER_INFO_NAME

GUIDE = Guide(GuideType.REGEX, "[a-z ]*")
END_ID = 151645  # <|im_end|>
PROMPTS = ((9707, 11, 1879, 0), (9707, 0), (1879, 11, 9707), (11, 1879, 0, 9707, 0))


def requests(decoder: ReferenceDecoder, text, batch: int, tokens: int,
             guide: Guide | None) -> list[DecodeRequest]:
    import torch

    out = []
    for i in range(batch):
        ids = PROMPTS[i % len(PROMPTS)]
        mrope = mrope_cos_sin_table(np.tile(np.arange(len(ids)), (3, 1)), text,
                                    decoder.config.max_position_embeddings)
        out.append(DecodeRequest(ids, torch.from_numpy(mrope.reshape(-1)), 0, guide=guide,
                                 sampling=SamplingParams(max_tokens=tokens, greedy=True,
                                                         end_id=END_ID, min_tokens=tokens,
                                                         stop_token_ids=(END_ID,))))
    return out


def decode(decoder: ReferenceDecoder, guided: GuidedDecoding, reqs: list[DecodeRequest]) \
        -> tuple[float, float, float, int]:
    """Wall and CPU seconds to decode `reqs` together, the wall seconds of their mask work
    within (DecodeBatch._guide: accept, fill, apply), and the tokens made."""
    batch = decoder.batch(guided)
    for r in reqs:
        batch.add(r)
    masking = 0.0
    guide = batch._guide  # timed from outside: the stand-in's own step stays as it is

    def timed(joining, logits) -> None:
        nonlocal masking
        start = time.perf_counter()
        guide(joining, logits)
        masking += time.perf_counter() - start

    batch._guide = timed
    made = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while batch:
        made += len(batch.step())
    return time.perf_counter() - wall, time.process_time() - cpu, masking, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="requests decoded together")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qvl-bench-guided-") as tmp:
        root = args.work_dir or Path(tmp)
        repo = build_tiny_reference_repo(root)
        llm = repo.path / "tensorrt_llm" / "1"
        decoder = ReferenceDecoder.load(llm / "checkpoint")
        info = TokenizerInfo.read(llm / TOKENIZER_INFO_NAME)
        guided = GuidedDecoding(dataclasses.replace(info, stop_token_ids=(END_ID,)),
                                decoder.config.vocab_size)
        text = open_checkpoint(root / "ckpt").text  # build_tiny_reference_repo's checkpoint
        runs: dict[str, list[tuple[float, float, float]]] = {"unguided": [], "guided": []}
        # The first round builds xgrammar's tables and warms the decoder: not measured.
        for n in range(args.rounds + 1):
            order = ("unguided", "guided") if n % 2 else ("guided", "unguided")
            for mode in order:
                reqs = requests(decoder, text, args.batch, args.tokens,
                                GUIDE if mode == "guided" else None)
                wall, cpu, masking, made = decode(decoder, guided, reqs)
                assert made == args.batch * args.tokens, made
                if n:
                    runs[mode].append((wall / made * 1e3, cpu / made * 1e3,
                                       masking / made * 1e3))
    wall = {m: statistics.median(w for w, _, _ in r) for m, r in runs.items()}
    cpu = {m: statistics.median(c for _, c, _ in r) for m, r in runs.items()}
    mask = statistics.median(k for _, _, k in runs["guided"])
    print(f"{args.rounds} interleaved rounds, {args.batch} requests x {args.tokens} tokens, "
          f"guide {GUIDE.type.value} {GUIDE.text!r}, vocab {decoder.config.vocab_size}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    for mode in runs:
        print(f"  {mode:9s} {wall[mode]:.3f} ms/token wall, {cpu[mode]:.3f} ms/token CPU")
    print(f"  guided/unguided {wall['guided'] / wall['unguided']:.2f}x wall, "
          f"{cpu['guided'] / cpu['unguided']:.2f}x CPU; difference "
          f"{wall['guided'] - wall['unguided']:.3f} ms/token wall; the mask work itself "
          f"(accept, fill, apply) {mask:.3f} ms/token")


if __name__ == "__main__":
    main()
