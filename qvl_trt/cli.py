"""The `qvl-trt` command line: parses options, calls one library function, prints.

Heavy packages are imported inside the library functions, so `--help` works without them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from . import __version__
from .errors import ConfigError, QvlError
from .profiles import TrtEdition

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


def _user_errors(fn: F) -> F:
    """Print a QvlError as one line and exit with its code; other exceptions are bugs and
    keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QvlError as exc:
            from .console import err

            err.print(f"[bold red]error:[/bold red] {exc}", highlight=False, markup=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def command(name: str | None = None, **kwargs) -> Callable[[F], F]:
    """`app.command` with user errors turned into one-line messages."""

    def register(fn: F) -> F:
        return app.command(name, **kwargs)(_user_errors(fn))

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


@command()
def gpus(json_out: JsonOpt = False) -> None:
    """List the shipped GPU profiles and their build limits."""
    from .console import gpus_table, out, print_json
    from .profiles import load_profile, profile_names

    profiles = [load_profile(n) for n in profile_names()]
    if json_out:
        print_json(profiles)
    else:
        out.print(gpus_table(profiles))


@command()
def inspect(model: ModelOpt, json_out: JsonOpt = False) -> None:
    """Describe a checkpoint: variant, dimensions, parameters, files."""
    from .checkpoint import open_checkpoint
    from .console import out, print_json

    summary = open_checkpoint(model).summary()
    if json_out:
        print_json(summary)
        return
    t, v = summary["text"], summary["vision"]
    out.print(
        f"[bold]{summary['path']}[/bold]: Qwen3-VL {summary['variant']}, "
        f"{summary['source_dtype']}, {summary['tensors']} tensors, "
        f"{summary['file_bytes'] / 2**30:.2f} GiB on disk"
    )
    out.print(
        f"  LLM: {summary['parameters']['llm'] / 1e9:.3f} B parameters, hidden "
        f"{t['hidden_size']}, {t['num_layers']} layers, {t['num_heads']}/"
        f"{t['num_kv_heads']} heads x {t['head_dim']}, vocab {t['vocab_size']}, "
        f"mrope {t['mrope_section']} interleaved={t['mrope_interleaved']}, "
        f"tied embeddings={t['tie_word_embeddings']}"
    )
    out.print(
        f"  vision: {summary['parameters']['vision'] / 1e9:.3f} B parameters, depth "
        f"{v['depth']}, hidden {v['hidden_size']}, out {v['out_hidden_size']}, "
        f"DeepStack after blocks {v['deepstack_visual_indexes']}"
    )


@command()
def plan(model: ModelOpt, gpu: GpuOpt, json_out: JsonOpt = False) -> None:
    """Check that a checkpoint fits a GPU profile: weights, KV cache, prompt table, capacity."""
    from .checkpoint import open_checkpoint
    from .console import out, plan_table, print_json
    from .plan import check_fits, make_plan
    from .profiles import load_profile
    from .typed_config import to_jsonable

    profile = load_profile(gpu)
    result = make_plan(open_checkpoint(model), profile)
    if json_out:
        print_json({**to_jsonable(result), "fits": result.fits})
    else:
        out.print(plan_table(result, profile))
    check_fits(result)


@command()
def doctor(json_out: JsonOpt = False) -> None:
    """Report Python, GPUs, TensorRT editions, TensorRT-LLM and Triton found here, and which
    profiles this machine can build for."""
    from .console import doctor_tables, out, print_json
    from .doctor import environment_report

    report = environment_report()
    if json_out:
        print_json(report)
        return
    for table in doctor_tables(report):
        out.print(table)


@command()
def build(
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", "-m", help="Hugging Face Qwen3-VL checkpoint folder."
        ),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu", "-g", help="GPU profile name or .toml path."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Build folder [default: build/GPU]."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated stages to run (inspect and plan always run): "
            "vision,llm,repo,manifest."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue the build in this folder with the options in its manifest.json."
        ),
    ] = None,
    trt_edition: Annotated[
        TrtEdition | None,
        typer.Option(
            help="TensorRT edition for the vision engine [default: the profile's]."
        ),
    ] = None,
    vision_dtype: Annotated[
        str,
        typer.Option(
            help="Vision engine precision: float16, or bfloat16 for checkpoints whose "
            "activations overflow fp16."
        ),
    ] = "float16",
    tp_size: Annotated[int, typer.Option(help="Tensor-parallel size of the LLM engine.")] = 1,
    force: Annotated[
        bool, typer.Option(help="Rebuild stages whose inputs did not change.")
    ] = False,
) -> None:
    """Build engines and the Triton repository: inspect -> plan -> vision -> llm -> repo ->
    manifest. Unchanged stages are skipped; exit code 3 means a stage needs another machine
    (the message says which command finishes it)."""
    from .build import BuildOptions, Stage, resume_build, run_build

    started = time.perf_counter()
    if resume:
        if model or gpu or only:
            raise ConfigError(
                "--resume takes its options from the manifest; drop --model, --gpu and --only"
            )
        result = resume_build(resume, force=force)
    else:
        if model is None or gpu is None:
            raise ConfigError("build needs --model and --gpu (or --resume DIR)")
        if vision_dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"--vision-dtype must be float16 or bfloat16, got {vision_dtype}")
        stages = None
        if only:
            try:
                stages = tuple(Stage(s.strip()) for s in only.split(",") if s.strip())
            except ValueError:
                raise ConfigError(
                    f"--only {only!r}: stages are {', '.join(s.value for s in Stage)}"
                ) from None
        options = BuildOptions(
            model=str(model.resolve()),
            gpu=_gpu_arg(gpu),
            trt_edition=trt_edition,
            vision_dtype=vision_dtype,
            tp_size=tp_size,
        )
        result = run_build(options, out or Path("build") / Path(gpu).stem, only=stages, force=force)
    from .console import out as console

    built = [r.stage.value for r in result.stages if r.status == "built"]
    skipped = [r.stage.value for r in result.stages if r.status == "skipped"]
    console.print(
        f"build done in {time.perf_counter() - started:.1f} s: built "
        f"{', '.join(built) or 'nothing'}; skipped {', '.join(skipped) or 'nothing'}"
        f" -> {result.out}"
    )


def _gpu_arg(gpu: str) -> str:
    """Profile paths are stored absolute so a resumed build finds them."""
    path = Path(gpu)
    return str(path.resolve()) if path.suffix == ".toml" else gpu


def main() -> None:
    app()


if __name__ == "__main__":
    main()
