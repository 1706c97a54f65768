"""The `qvl-trt` Typer app: its options shared between commands, the command decorator that
turns user errors into one-line messages, and the entry point. The commands live in one
module per help panel (diagnostics.py, build.py, serve.py); tables and longer renderings come
from console.py. A command parses its options, calls library functions that do the work and
prints what they return.

Heavy packages are imported inside the library functions, so `--help` works without them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from .. import __version__
from ..dtypes import WeightOnly
from ..errors import ConfigError, QvlError
from ..serve.server import Ports

F = TypeVar("F", bound=Callable)


app = typer.Typer(
    name="qvl-trt",
    help="Turn a Hugging Face Qwen3-VL checkpoint into TensorRT engines (vision encoder + "
    "TensorRT-LLM language model) and a Triton model repository.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


ModelOpt = Annotated[
    Path,
    typer.Option(
        "--model", "-m", help="Hugging Face Qwen3-VL checkpoint folder.", show_default=False
    ),
]


GpuOpt = Annotated[
    str,
    typer.Option(
        "--gpu",
        "-g",
        help="GPU profile name (see `qvl-trt gpus`) or path to a profile .toml.",
        show_default=False,
    ),
]


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
WEIGHTS_HELP = ("Language-model linear weights: none (the engine dtype), or int8/int4 "
                "weight-only (per-channel scales, no calibration; embedding and lm_head stay "
                "fp16).")
WeightsOpt = Annotated[WeightOnly, typer.Option("--weights", help=WEIGHTS_HELP)]
WORKLOAD_HELP = ("What the limits are sized for: chat (the profile's), video (one request "
                 "may carry the checkpoint's whole clip budget; the batch lowered where the "
                 "prompt table costs) or long (256K context where the KV cache holds it, else "
                 "128K); docs/build.md \"Workloads\".")


def per_model(values: list | None, models: int, option: str, default: Any) -> list:
    """A repeatable option given once for every --model or once per --model, one value per
    model ([default] when it is not given)."""
    if values and len(values) not in (1, models):
        raise ConfigError(f"{len(values)} {option} for {models} --model: give one for all of "
                          "them, or one per --model in the same order")
    given = values or [default]
    return given * models if len(given) == 1 else list(given)


def _user_errors(fn: F) -> F:
    """Print a QvlError as one line and exit with its code; other exceptions are bugs and
    keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QvlError as exc:
            from rich.markup import escape

            from .console import err

            # escape: "pip install 'qvl-trt[rtx]'" must not be read as a markup tag.
            err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False,
                      markup=True)
            raise typer.Exit(exc.exit_code) from None
        except ModuleNotFoundError as exc:
            if (exc.name or "qvl_trt").split(".")[0] == "qvl_trt":
                raise  # our own module missing: a broken install, keep the traceback
            from .console import err

            # A dependency every command path imports (numba, xxhash, ...) is missing.
            err.print(f"error: {exc.name} is not installed in this Python ({sys.executable}); "
                      "reinstall qvl-trt there, or in a serving image regenerate its recipe "
                      "with `qvl-trt image`", highlight=False, markup=False)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def command(name: str | None = None, *, panel: str) -> Callable[[F], F]:
    """`app.command` with user errors turned into one-line messages, listed under `panel` in
    the help."""

    def register(fn: F) -> F:
        return app.command(name, rich_help_panel=panel)(_user_errors(fn))

    return register


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qvl-trt {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: Annotated[
        int,
        typer.Option(
            "--verbose", "-v", count=True, help="More logging: -v for debug, -vv for libraries."
        ),
    ] = 0,
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
) -> None:
    from .console import setup_logging

    setup_logging(verbose)


UrlOpt = Annotated[str, typer.Option(help="Deployment: grpc://HOST:PORT (streaming gRPC) or "
                                     "http://HOST:PORT (HTTP generate_stream).")]
# Where `qvl-trt serve` listens with its default ports, as a client on this machine sees it.
LOCAL_GRPC_URL = f"grpc://127.0.0.1:{Ports.grpc}"


VideoOpt = Annotated[list[Path] | None, typer.Option(
    help="Video file: MP4, WebM, MKV, ... (repeat for several; after the images).")]


def read_media(images: list[Path] | None, videos: list[Path] | None
               ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """The files of --image and --video, read (a missing one refused by name)."""
    from ..mm.image_input import read_image_files

    return (tuple(read_image_files(images or [])),
            tuple(read_image_files(videos or [], option="--video")))


VideoFpsOpt = Annotated[float | None, typer.Option(
    help="Frames per second the videos are sampled at [default: the checkpoint's, 2].")]


ServedModelOpt = Annotated[str, typer.Option("--served-model", help="Ensemble name in the "
                                             "repository (a named build's name).")]


def main() -> None:
    app()
