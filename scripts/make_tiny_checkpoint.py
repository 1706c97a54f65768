"""Write a tiny random Qwen3-VL checkpoint (or a released config without weights).

python scripts/make_tiny_checkpoint.py OUT [--seed S] [--dims k=v,...] [--untied]
    [--shards N] [--dtype float32|float16|bfloat16]
python scripts/make_tiny_checkpoint.py OUT --config-only 2b|4b|8b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qvl_trt.dtypes import Dtype
from qvl_trt.errors import QvlError
from qvl_trt.testing.tiny_checkpoint import (
    RELEASED,
    TinyDims,
    parse_dims,
    write_config_only,
    write_tiny_checkpoint,
)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.config_only:
            out = write_config_only(args.out, args.config_only)
        else:
            out = write_tiny_checkpoint(
                args.out,
                seed=args.seed,
                dims=parse_dims(args.dims),
                tie_word_embeddings=not args.untied,
                dtype=args.dtype,
                shards=args.shards,
            )
    except QvlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to create (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    defaults = ",".join(f"{k}={_dim_text(v)}" for k, v in vars(TinyDims()).items())
    parser.add_argument(
        "--dims",
        default="",
        help=f"size overrides, e.g. text_hidden=128,text_layers=3; tuples as a:b:c. "
        f"Defaults: {defaults}",
    )
    parser.add_argument("--untied", action="store_true", help="separate lm_head (like the 8B)")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files (default 1)")
    parser.add_argument("--dtype", choices=[d.value for d in Dtype], default="float32",
                        help="weight dtype")
    parser.add_argument(
        "--config-only",
        choices=sorted(RELEASED),
        help="write the released config of this variant, without weights",
    )
    return parser


def _dim_text(value: int | tuple[int, ...]) -> str:
    return ":".join(map(str, value)) if isinstance(value, tuple) else str(value)


if __name__ == "__main__":
    sys.exit(main())
