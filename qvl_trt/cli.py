"""The `qvl-trt` command line. A command parses its options, calls library functions that do
the work and prints what they return (tables and the longer renderings come from
console.py).

Heavy packages are imported inside the library functions, so `--help` works without them.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from . import __version__
from .dtypes import Dtype
from .errors import ConfigError, QvlError
from .profiles import TrtEdition
from .triton.model_configs import Flavor

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


@command(panel="Inspect and debug")
def gpus(json_out: JsonOpt = False) -> None:
    """List the shipped GPU profiles and their build limits."""
    from .console import gpus_table, out, print_json
    from .profiles import load_profile, profile_names

    profiles = [load_profile(n) for n in profile_names()]
    if json_out:
        print_json(profiles)
    else:
        out.print(gpus_table(profiles))


@command(panel="Inspect and debug")
def inspect(model: ModelOpt, json_out: JsonOpt = False) -> None:
    """Describe a checkpoint: variant, dimensions, parameters, files."""
    from .checkpoint import open_checkpoint
    from .console import inspect_lines, out, print_json

    summary = open_checkpoint(model).summary()
    if json_out:
        print_json(summary)
        return
    for line in inspect_lines(summary):
        out.print(line)


@command(panel="Build")
def plan(model: ModelOpt, gpu: Annotated[str, typer.Option(
            "--gpu", "-g", help="GPU profile name (see `qvl-trt gpus`), path to a profile "
            ".toml, or `all`: one row per shipped profile (exit 0 whatever fits).")],
         json_out: JsonOpt = False) -> None:
    """Check that a checkpoint fits a GPU profile: weights, KV cache, prompt table, capacity."""
    from .checkpoint import open_checkpoint
    from .console import out, plan_all_notes, plan_all_table, plan_table, print_json
    from .plan import check_fits, make_plan, plan_every_profile
    from .profiles import load_profile
    from .typed_config import to_jsonable

    ckpt = open_checkpoint(model)
    if gpu.strip().lower() == "all":
        rows = plan_every_profile(ckpt)
        if json_out:
            print_json([{**to_jsonable(p), "fits": p.fits, "resident_bytes": p.resident_bytes}
                        for _, p in rows])
        else:
            out.print(plan_all_table(rows))
            for note in plan_all_notes(rows):
                out.print(note, markup=False, highlight=False)
        return
    profile = load_profile(gpu)
    result = make_plan(ckpt, profile)
    if json_out:
        print_json({**to_jsonable(result), "fits": result.fits})
    else:
        out.print(plan_table(result, profile))
    check_fits(result)


@command(panel="Inspect and debug")
def doctor(
    repo: Annotated[Path | None, typer.Option(
        help="Also check what serving this model repository needs here (world size, the "
        "vision engines' TensorRT edition, shared memory, and that each python model loads "
        "in a tritonserver of this Python); exit 1 on a failed check.",
        show_default=False)] = None,
    load: Annotated[bool, typer.Option(
        help="With --repo: load each python model (runs its initialize: seconds per model, "
        "longer for the reference flavor's PyTorch models).")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Report Python, GPUs, TensorRT editions, TensorRT-LLM and Triton found here, and which
    profiles this machine can build for."""
    from .console import doctor_tables, out, print_json, readiness_table
    from .machine import environment_report
    from .typed_config import to_jsonable

    report = environment_report()
    readiness = ()
    if repo is not None:
        from .triton.serve_plan import read_serve_plan, serve_readiness

        readiness = serve_readiness(read_serve_plan(repo), load_models=load)
    if json_out:
        print_json({**to_jsonable(report), "serve_checks": to_jsonable(readiness)})
    else:
        for table in doctor_tables(report):
            out.print(table)
        if readiness:
            out.print(readiness_table(repo, readiness))
    if not all(r.ok for r in readiness):
        raise typer.Exit(1)


@command(panel="Build")
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
            help="Comma-separated stages to run (inspect and plan always run; llm runs "
            "llm_checkpoint too): vision,llm,repo,manifest."
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
        Dtype,
        typer.Option(
            help="Vision engine precision: float16, or bfloat16 for checkpoints whose "
            "activations overflow fp16."
        ),
    ] = Dtype.FLOAT16,
    tp_size: Annotated[int, typer.Option(help="Tensor-parallel size of the LLM engine.")] = 1,
    force: Annotated[
        bool, typer.Option(help="Rebuild stages whose inputs did not change.")
    ] = False,
) -> None:
    """Build engines and the Triton repository: inspect -> plan -> vision -> llm_checkpoint ->
    llm -> repo -> manifest. Unchanged stages are skipped; exit code 3 means a stage needs
    another machine (the message says which command finishes it)."""
    from .build import BuildOptions, Stage, resume_build, run_build
    from .console import build_line
    from .console import out as console
    from .profiles import profile_argument

    started = time.perf_counter()
    stages = Stage.parse_list(only) if only else None
    if resume:
        if model or gpu:
            raise ConfigError(
                "--resume takes its options from the manifest; drop --model and --gpu"
            )
        result = resume_build(resume, only=stages, force=force)
    else:
        if model is None or gpu is None:
            raise ConfigError("build needs --model and --gpu (or --resume DIR)")
        options = BuildOptions(
            model=str(model.resolve()),
            gpu=profile_argument(gpu),
            trt_edition=trt_edition,
            vision_dtype=vision_dtype,
            tp_size=tp_size,
        )
        result = run_build(options, out or Path("build") / Path(gpu).stem, only=stages, force=force)
    console.print(build_line(result, time.perf_counter() - started))


@command(panel="Build")
def convert(
    model: ModelOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the TensorRT-LLM "
                                      "checkpoint into.", show_default=False)],
    gpu: Annotated[str | None, typer.Option(
        "--gpu", "-g", help="GPU profile whose limits.max_seq_len bounds "
        "max_position_embeddings.")] = None,
    max_seq_len: Annotated[int | None, typer.Option(
        help="Engine max_seq_len (instead of --gpu).")] = None,
    dtype: Annotated[Dtype, typer.Option(help="float16, bfloat16 (or float32 for tests).")]
    = Dtype.FLOAT16,
    tp_size: Annotated[int, typer.Option(help="Tensor-parallel ranks.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Convert the language model of an HF Qwen3-VL checkpoint into a TensorRT-LLM checkpoint
    (config.json + rank{N}.safetensors), streaming one tensor at a time."""
    from .console import out as console
    from .console import print_json
    from .llm.convert import convert_checkpoint, resolve_max_seq_len

    result = convert_checkpoint(model, out, max_seq_len=resolve_max_seq_len(gpu, max_seq_len),
                                dtype=dtype, tp_size=tp_size, force=force)
    if json_out:
        print_json({"out": str(result.out), "rank_files": result.rank_files,
                    "total_bytes": result.total_bytes, "seconds": round(result.seconds, 3),
                    "config": result.config})
        return
    console.print(f"converted {model} -> {result.out}: {result.config.dtype}, TP "
                  f"{result.config.tp_size}, max_position_embeddings "
                  f"{result.config.max_position_embeddings}, "
                  f"{result.total_bytes / 2**30:.2f} GiB in {result.seconds:.1f} s")


@command(panel="Build")
def matrix(
    model: ModelOpt,
    gpus: Annotated[str, typer.Option(help="`all`, or comma-separated profile names or "
                                      ".toml paths.")] = "all",
    build_root: Annotated[str, typer.Option(help="Folder holding one build folder per "
                                            "profile.")] = "build",
) -> None:
    """Print a CI job matrix as JSON: one job per GPU profile with runner labels by compute
    capability, container image and the build's cache key (computed without building).
    GitHub Actions: `strategy.matrix: ${{ fromJSON(...) }}`; see .github/workflows/engines.yml."""
    import json

    from .build.matrix import ci_matrix

    typer.echo(json.dumps(ci_matrix(model, gpus, build_root=build_root), indent=2))


@command("export-vision", panel="Build")
def export_vision(
    model: ModelOpt,
    dtype: Annotated[Dtype, typer.Option(
        help="float16 or bfloat16 (what the engine is built from), or float32 (the reference "
        "graph).")] = Dtype.FLOAT16,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder to create for model.onnx + its weights "
        "[default: build/vision-onnx-DTYPE].", show_default=False)] = None,
    trt_edition: Annotated[TrtEdition, typer.Option(
        help="The TensorRT edition the graph is for: tensorrt_rtx writes attention as the "
        "ONNX Attention op (opset 23), tensorrt as MatMul-Softmax-MatMul (opset 18, "
        "TensorRT 10.13).")] = TrtEdition.TENSORRT_RTX,
) -> None:
    """Export the vision tower to ONNX with a dynamic patch count, then check it against the
    Hugging Face tower: one line per output with the max difference and PASS/FAIL."""
    from .checkpoint import open_checkpoint
    from .console import out as console
    from .vision.validate import export_and_validate

    onnx, validation = export_and_validate(
        open_checkpoint(model), out or Path("build") / f"vision-onnx-{dtype}", dtype=dtype,
        edition=trt_edition)
    console.print(f"validation vs Hugging Face ({validation.graph}):", highlight=False)
    for line in validation.lines():
        console.print(f"  {line}", highlight=False)
    validation.raise_if_failed()
    console.print(f"exported {onnx.path} ({dtype}, opset {onnx.opset}, dynamic "
                  f"num_patches) in {onnx.seconds:.1f} s", highlight=False)


UrlOpt = Annotated[str, typer.Option(help="Deployment: grpc://HOST:PORT (streaming gRPC) or "
                                     "http://HOST:PORT (HTTP generate_stream).")]
VideoOpt = Annotated[list[Path] | None, typer.Option(
    help="Video file: MP4, WebM, MKV, ... (repeat for several; after the images).")]
VideoFpsOpt = Annotated[float | None, typer.Option(
    help="Frames per second the videos are sampled at [default: the checkpoint's, 2].")]
ServedModelOpt = Annotated[str, typer.Option("--served-model", help="Ensemble name in the "
                                             "repository (a named build's name).")]


@command(panel="Serve and measure")
def infer(
    prompt: Annotated[str, typer.Option(help="The question.", show_default=False)],
    url: UrlOpt = "grpc://127.0.0.1:8001",
    image: Annotated[list[Path] | None, typer.Option(
        help="Image file (repeat for several).")] = None,
    video: VideoOpt = None,
    video_fps: VideoFpsOpt = None,
    stream: Annotated[bool, typer.Option(help="Print the answer as it is generated.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Top-k sampling.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    served_model: ServedModelOpt = "ensemble",
    json_out: JsonOpt = False,
) -> None:
    """Ask a deployment one question about images and videos; prints the answer, then time to
    first token, tokens/s and token counts."""
    from .client.bench import ask
    from .client.generate import GenerateRequest
    from .console import infer_json, infer_line, print_json
    from .console import out as console
    from .mm.image_input import read_image_files

    req = GenerateRequest(prompt, tuple(read_image_files(image or [])), max_tokens,
                          temperature, top_p, top_k, seed, tuple(stop or ()), stream,
                          tuple(read_image_files(video or [], option="--video")), video_fps)

    def show(response) -> None:
        console.print(response.text, end="", markup=False, highlight=False)

    answer = ask(url, req, model=served_model,
                 on_response=show if stream and not json_out else None)
    answer.raise_if_failed()
    if json_out:
        print_json(infer_json(answer))
        return
    console.print(answer.text if not stream else "", markup=False, highlight=False)
    console.print(infer_line(answer))


@command(panel="Serve and measure")
def bench(
    url: UrlOpt = "grpc://127.0.0.1:8001",
    images: Annotated[Path | None, typer.Option(help="Folder of images, sent in turn.")]
    = None,
    synthetic: Annotated[str | None, typer.Option(
        help="WIDTHxHEIGHT: random-noise images, a different one per request.")] = None,
    synthetic_video: Annotated[str | None, typer.Option(
        help="WIDTHxHEIGHTxFRAMES: MP4 clips of moving colour ramps at 2 fps (the model sees "
             "every frame), a different one per request.")] = None,
    videos_per_request: Annotated[int, typer.Option(
        help="Videos per request (with --synthetic-video).")] = 1,
    seed: Annotated[int | None, typer.Option(
        help="Repeat the --synthetic images and videos of a run with this seed (default: new "
             "ones every run, so the server's vision cache does not answer them).")] = None,
    concurrency: Annotated[str, typer.Option(help="Requests in flight, per level.")] = "1,4,16",
    requests: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request.")] = 128,
    prompt: Annotated[str, typer.Option(help="The question of every request.")]
    = "Describe this image.",
    images_per_request: Annotated[int, typer.Option(help="Images per request.")] = 1,
    warmup: Annotated[int, typer.Option(help="Unmeasured requests sent first.")] = 1,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for bench.json, bench.csv "
                                      "and bench.png.")] = Path("bench-results"),
    allow_remote: Annotated[bool, typer.Option(help="Allow a server that is not on this "
                                               "machine.")] = False,
    served_model: ServedModelOpt = "ensemble",
) -> None:
    """Benchmark a deployment at several concurrencies: TTFT, inter-token latency, request
    latency, throughput (genai-perf's definitions, see the README). Writes JSON, CSV and a
    PNG plot of latency vs throughput."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .client.bench import (
        BenchSettings,
        image_source,
        parse_concurrency,
        run_benchmark,
        synthetic_videos,
    )
    from .client.bench_report import write_reports
    from .console import bench_tables
    from .console import out as console

    source, name = image_source(images, synthetic, seed)
    videos = synthetic_videos(synthetic_video, seed) if synthetic_video else None
    settings = BenchSettings(url, parse_concurrency(concurrency), requests, max_tokens, prompt,
                             images_per_request, warmup, served_model, allow_remote,
                             videos_per_request)
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {c: progress.add_task(f"concurrency {c}", total=requests)
                 for c in settings.concurrency}
        report = run_benchmark(settings, source, source=name,
                               on_done=lambda c, _: progress.advance(tasks[c]), videos=videos)
    for table in bench_tables(report.levels):
        console.print(table)
    paths = write_reports(report, out)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}")


@command(panel="Inspect and debug")
def preprocess(
    model: ModelOpt,
    prompt: Annotated[str, typer.Option(help="The question (one user turn, images first).",
                                        show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .npz file to write.",
                                      show_default=False)],
    image: Annotated[list[Path] | None, typer.Option(
        help="Image file (repeat for several).")] = None,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", "-g", help="GPU profile whose limits apply (pixel cap, image count, "
        "max_input_len, MRoPE table length = max_seq_len) [default: the checkpoint's own, "
        "a table of max_position_embeddings rows].")] = None,
) -> None:
    """Run one request's host preprocessing and save every tensor it produces (.npz, names in
    the README): pixel values, grids, input ids before and after fake-id substitution,
    position ids, MRoPE table and delta, vision index inputs."""
    from .console import out as console
    from .mm.request import prepare_files
    from .profiles import profile_argument

    request = prepare_files(model, image or [], prompt,
                            gpu=profile_argument(gpu) if gpu else None)
    path = request.save_npz(out)
    console.print(f"{request.num_tokens} prompt tokens ({sum(request.image_token_counts)} "
                  f"visual, {len(request.images)} images), position delta "
                  f"{request.mrope_position_delta} -> {path}")


@command(panel="Inspect and debug")
def generate(
    model: ModelOpt,
    prompt: Annotated[str, typer.Option(help="The user's text.", show_default=False)],
    image: Annotated[list[Path] | None, typer.Option(
        help="Image file (repeat for several); shown before the text.")] = None,
    video: VideoOpt = None,
    video_fps: VideoFpsOpt = None,
    checkpoint: Annotated[Path | None, typer.Option(
        help="TensorRT-LLM checkpoint written by `qvl-trt convert` from --model [default: "
        "convert into a temporary folder].")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    greedy: Annotated[bool, typer.Option(help="Pick the most likely token.")] = False,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature [default: the checkpoint's generation_config].")] = None,
    top_k: Annotated[int | None, typer.Option(help="Top-k (0 = off).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus mass (1 = off).")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    stream: Annotated[bool, typer.Option(help="Print tokens as they are generated.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    max_seq_len: Annotated[int, typer.Option(
        help="max_position_embeddings of the temporary conversion.")] = 8192,
    json_out: Annotated[bool, typer.Option("--json", help="Print the token ids and text as "
                                           "JSON (with --stream: one JSON line per token).")]
    = False,
) -> None:
    """Answer a prompt about images and videos in process with the PyTorch reference pipeline
    (no Triton): qvl_trt preprocessing -> vision tower -> prompt table -> reference decoder on
    the converted TensorRT-LLM checkpoint."""
    import json

    from .console import out as console
    from .console import print_json
    from .llm.pipeline import ReferencePipeline, sampling_params
    from .mm.image_input import read_image_files
    from .mm.video_input import VideoFile

    images = read_image_files(image or [])
    videos = [VideoFile(data, video_fps)
              for data in read_image_files(video or [], option="--video")]
    sampling = sampling_params(model, max_tokens=max_tokens, greedy=greedy,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    pipeline = ReferencePipeline.load(model, checkpoint=checkpoint, device=device,
                                      max_seq_len=max_seq_len)

    def show(delta) -> None:
        if json_out:
            typer.echo(json.dumps({"token_id": delta.token_id, "text": delta.text}))
        else:
            console.print(delta.text, end="", markup=False, highlight=False)

    result = pipeline.ask(prompt, images, sampling=sampling, on_text=show if stream else None,
                          videos=videos)
    if json_out:
        summary = {"text": result.text, "token_ids": list(result.token_ids),
                   "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                   "image_tokens": result.image_tokens,
                   "completion_tokens": result.completion_tokens}
        typer.echo(json.dumps(summary)) if stream else print_json(summary)
        return
    console.print("" if stream else result.text, markup=False, highlight=False)
    console.print(f"[dim]{result.completion_tokens} tokens ({result.finish_reason.value}); "
                  f"prompt {result.prompt_tokens} tokens, {result.image_tokens} of them for "
                  f"{'images and videos' if videos else 'images'}[/dim]")


@command(panel="Serve and measure")
def verify(
    cases: Annotated[Path, typer.Option(help="JSON (list) or JSON-lines file of cases: "
                                        "prompt, images, videos, video_fps, max_tokens, "
                                        "must_match, name.", show_default=False)],
    against: Annotated[str, typer.Option(help="`reference` (in-process PyTorch pipeline) or "
                                         "a second deployment's grpc://HOST:PORT.",
                                         show_default=False)],
    url: UrlOpt = "grpc://127.0.0.1:8001",
    model: Annotated[Path | None, typer.Option(
        "--model", "-m", help="HF checkpoint of the deployment (for --against reference).")]
    = None,
    llm_checkpoint: Annotated[Path | None, typer.Option(
        help="Converted TensorRT-LLM checkpoint for the reference (a build's "
        "llm_checkpoint folder) [default: convert --model on the fly].")] = None,
    must_match: Annotated[int | None, typer.Option(
        help="Leading tokens that must agree per case [default: all].")] = None,
    served_model: ServedModelOpt = "ensemble",
    json_out: JsonOpt = False,
) -> None:
    """Compare a deployment's greedy token ids with a reference, case by case; report the
    first divergence; exit 1 if any case differs within its must-match prefix."""
    from .client.verify import load_cases, open_sides
    from .client.verify import verify as run_verify
    from .console import out as console
    from .console import print_json, verify_json, verify_line

    case_list = load_cases(cases)

    def show(result) -> None:
        console.print(verify_line(result), highlight=False)

    with open_sides(url, against, served_model=served_model, model=model,
                    llm_checkpoint=llm_checkpoint) as (reference, candidate):
        results = run_verify(case_list, reference, candidate, must_match=must_match,
                             on_case=None if json_out else show)
    failed = [r for r in results if not r.passed]
    if json_out:
        print_json(verify_json(results))
    else:
        console.print(f"{len(results) - len(failed)} of {len(results)} cases match")
    if failed:
        raise typer.Exit(1)


@command(panel="Build")
def repo(
    build: Annotated[list[str], typer.Option(
        "--build", "-b", help="Build folder, or NAME=FOLDER; repeat for several builds in one "
        "repository (each gets its own model names: NAME, NAME_preprocessing, ...).",
        show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Repository folder to write.",
                                      show_default=False)],
    flavor: Annotated[Flavor, typer.Option(
        help="trt: vision engine + stock tensorrtllm backend; reference: PyTorch vision tower "
        "and reference decoder (any machine, CPU included).")] = Flavor.TRT,
    mount_path: Annotated[str | None, typer.Option(
        help="Where the repository will be mounted when served (the tensorrtllm backend takes "
        "an absolute engine path) [default: --out].")] = None,
    default_max_tokens: Annotated[int, typer.Option(
        help="max_tokens of requests that give none.")] = 512,
    vision_cache_mib: Annotated[int, typer.Option(
        help="Size of the vision encoder's cache of image embeddings.")] = 512,
    allow_image_host: Annotated[list[str] | None, typer.Option(
        help="Host whose http(s) image URLs the server may fetch (repeatable) [default: none, "
        "images come as data URIs or bytes].")] = None,
    postprocessing_instances: Annotated[int | None, typer.Option(
        min=1, help="Instances of postprocessing and tensorrt_llm_bls, which turn the "
        "engine's tokens into streamed text [default: one per 4 cores of this machine, 1 to "
        "4].")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write a Triton model repository from one or more build folders."""
    from .console import out as console
    from .triton.repository import BuildInput, RepoOptions, write_repo

    counts = {} if postprocessing_instances is None else {
        "postprocessing_instances": postprocessing_instances}
    options = RepoOptions(flavor=flavor, mount_path=mount_path,
                          default_max_tokens=default_max_tokens,
                          vision_cache_mib=vision_cache_mib,
                          image_url_allow_list=tuple(allow_image_host or ()), **counts)
    result = write_repo([BuildInput.parse(b) for b in build], out, options, force=force)
    ensembles = ", ".join(b.names.ensemble for b in result.builds)
    console.print(f"wrote the {flavor.value} repository {result.path}: {len(result.models)} "
                  f"models; ensemble{'s' if len(result.builds) > 1 else ''}: {ensembles}")
    if flavor is Flavor.TRT:
        console.print("write its serving image recipe (the TensorRT-LLM container plus what "
                      f"its models import) with: qvl-trt image --repo {result.path} --out "
                      f"{result.path.parent / 'image'}", highlight=False, markup=False,
                      soft_wrap=True)


@command(panel="Serve and measure")
def image(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the Docker build "
                                      "context to.", show_default=False)],
    repo: Annotated[Path | None, typer.Option(
        help="The repository the image will serve: its vision engines decide whether "
        "TensorRT-RTX goes in, and the `docker run` line serves it.",
        show_default=False)] = None,
    rtx: Annotated[bool | None, typer.Option(
        "--rtx/--no-rtx", help="Install TensorRT-RTX, which GeForce profiles' vision engines "
        "run on [default: whether --repo has such an engine].", show_default=False)] = None,
    tag: Annotated[str | None, typer.Option(
        help="Image tag [default: qvl-trt:VERSION-rtx or -trt].", show_default=False)] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write the serving image recipe: a Dockerfile FROM the TensorRT-LLM container that adds
    exactly what qvl-trt's python models and `qvl-trt serve` import and the container lacks,
    pinned so that nothing it already has is upgraded; qvl-trt itself goes in as source.
    Print the `docker build` line, and the `docker run` line that serves --repo."""
    from .console import out as console
    from .deploy.image import write_image_recipe

    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it")
    plan = None
    if repo is not None:
        from .profiles import TrtEdition
        from .triton.serve_plan import read_serve_plan

        if not repo.is_dir():
            raise ConfigError(f"{repo} is not a folder; pass a model repository written by "
                              "`qvl-trt repo`")
        plan = read_serve_plan(repo)
        if rtx is None:
            rtx = TrtEdition.TENSORRT_RTX in plan.vision_editions.values()
    recipe = write_image_recipe(out, rtx=bool(rtx), tag=tag)
    console.print(f"wrote the image recipe {out}: adds {', '.join(recipe.requirements)}",
                  highlight=False, markup=False, soft_wrap=True)
    console.print(f"build it with: {recipe.build_command}", highlight=False, markup=False,
                  soft_wrap=True)
    if plan is not None:
        from .triton.serve_plan import serve_container_command

        console.print(f"serve {repo} with: {serve_container_command(plan, recipe.tag)}",
                      highlight=False, markup=False, soft_wrap=True)


@command(panel="Inspect and debug")
def validate(
    repository: Annotated[Path, typer.Argument(help="Model repository folder.",
                                               show_default=False)],
    json_out: JsonOpt = False,
) -> None:
    """Check a model repository: configs parse, ensemble maps agree with the models (name,
    dtype, dims), engines exist and match the GPU profile and TensorRT edition. Exit 1 on any
    problem."""
    from .console import out as console
    from .console import print_json, validate_json, validate_lines
    from .triton.validate import validate_repo

    report = validate_repo(repository)
    if json_out:
        print_json(validate_json(report))
    else:
        for line in validate_lines(report):
            console.print(line, highlight=False)
    if not report.ok:
        raise typer.Exit(1)


@command(panel="Serve and measure")
def serve(
    repository: Annotated[Path, typer.Argument(help="Model repository folder.",
                                               show_default=False)],
    http_port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port.")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port.")] = 8002,
    free_ports: Annotated[bool, typer.Option(
        help="Pick three free ports instead of the port options.")] = False,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    world_size: Annotated[int | None, typer.Option(
        help="GPUs (tensor-parallel ranks) of the LLM engine: > 1 launches one tritonserver "
        "rank per GPU through mpirun [default: the engines' world size; a different value "
        "is refused].", show_default=False)] = None,
    log_file: Annotated[Path | None, typer.Option(
        help="Write the server's log here instead of the terminal.")] = None,
    log_verbose: Annotated[int, typer.Option(help="Triton's --log-verbose level.")] = 0,
    health_port: Annotated[int | None, typer.Option(
        help="Answer GET /ready (200 only while the end-to-end probe passes and no restart "
        "is under way, else 503) and /live on this port [default: none].",
        show_default=False)] = None,
    openai_port: Annotated[int | None, typer.Option(
        help="Also run the OpenAI-compatible gateway and chat page (`qvl-trt gateway`) on "
        "this port, in front of the server's gRPC endpoint; QVL_TRT_API_KEY in the "
        "environment makes it ask for that key [default: none].",
        show_default=False)] = None,
    openai_host: Annotated[str | None, typer.Option(
        help="Address the gateway listens on [default: --host].", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option(
        help="Print the command it would run, and exit.")] = False,
) -> None:
    """Run tritonserver on a repository (PATH, /opt/tritonserver or the nvidia-pytriton
    binary); wait until it is ready, print its addresses, restart it when a model dies or
    stops answering, stop it cleanly on Ctrl-C or SIGTERM (a second one forces it). With
    --openai-port, the gateway starts once the server is ready, starts again if it exits on
    its own, and stops before the server."""
    from .console import out as console
    from .triton.serve_plan import (
        check_vision_editions,
        point_engine_paths,
        read_serve_plan,
        resolve_world_size,
        shm_size_bytes,
        warn_small_shm,
    )
    from .triton.server import (
        Ports,
        ServerOptions,
        TritonServer,
        client_host,
        format_command,
        require_tritonserver,
        server_command,
    )
    from .triton.server import free_ports as pick_ports
    from .triton.supervisor import Supervisor

    if not repository.is_dir():
        raise ConfigError(f"{repository} is not a folder; pass a model repository written by "
                          "`qvl-trt repo`")
    needs = read_serve_plan(repository)
    install = require_tritonserver()
    ports = pick_ports(host if host != "0.0.0.0" else "127.0.0.1") if free_ports else \
        Ports(http_port, grpc_port, metrics_port)
    opts = ServerOptions(repository, ports, host=host,
                         world_size=resolve_world_size(needs, world_size),
                         llm_models=needs.llm_models, thread_pool_size=needs.thread_pool_size,
                         log_verbose=log_verbose)
    if dry_run:
        console.print(format_command(server_command(install, opts), install), highlight=False,
                      markup=False, soft_wrap=True)
        return
    gateway = None
    if openai_port is not None:
        from .gateway.app import API_KEY_ENV, GatewayOptions
        from .gateway.process import GatewayProcess

        gateway = GatewayProcess(GatewayOptions(f"{client_host(host)}:{ports.grpc}",
                                                host=openai_host or host, port=openai_port,
                                                api_key=os.environ.get(API_KEY_ENV)))
    check_vision_editions(needs)
    warn_small_shm(needs, shm_size_bytes())
    point_engine_paths(needs)
    server = TritonServer(opts, install=install, log_file=log_file)
    health = f", readiness http://{server.client_host}:{health_port}/ready" \
        if health_port is not None else ""

    def ready() -> None:
        console.print(f"tritonserver ({install.origin}) ready: HTTP {server.http_url}, gRPC "
                      f"{server.grpc_url}, metrics {server.metrics_url}{health}; Ctrl-C stops "
                      "it", highlight=False)
        if gateway is not None:
            gateway.wait_ready()
            console.print(f"OpenAI endpoint {gateway.url}/v1, chat page {gateway.url}/",
                          highlight=False)

    supervisor = Supervisor(server, needs.ensembles, health_port=health_port, on_ready=ready,
                            companions=(gateway,) if gateway is not None else ())
    code = supervisor.run()
    if code not in (0, None):
        raise typer.Exit(code)


@command(panel="Serve and measure")
def deploy(
    repo: Annotated[Path, typer.Option(
        help="trt model repository (`qvl-trt repo` / `qvl-trt build`) the pods serve.",
        show_default=False)],
    image: Annotated[str, typer.Option(
        help="Serving image with `qvl-trt` and `tritonserver` on PATH, e.g. "
        "registry.example.com/qvl-trt-serve:4090d.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the manifests into.",
                                      show_default=False)],
    name: Annotated[str | None, typer.Option(
        help="Name of the Deployment, the Service and the rest [default: qvl-trt].",
        show_default=False)] = None,
    namespace: Annotated[str | None, typer.Option(
        help="Namespace [default: kubectl's current one].", show_default=False)] = None,
    replicas: Annotated[int | None, typer.Option(
        help="Pods, each a whole server on one node (with --hpa: the minimum) [default: one].",
        show_default=False)] = None,
    openai_port: Annotated[int | None, typer.Option(
        help="Port of the OpenAI gateway in the pod and the Service [default: the gateway's "
        "default port].", show_default=False)] = None,
    health_port: Annotated[int | None, typer.Option(
        help="serve's --health-port, which the probes ask [default: the port after Triton's "
        "three].", show_default=False)] = None,
    mount_path: Annotated[str | None, typer.Option(
        help="Where the pods see the repository [default: the path it was written for; "
        "another needs `qvl-trt repo --mount-path`].", show_default=False)] = None,
    claim: Annotated[str | None, typer.Option(
        help="PersistentVolumeClaim holding the repository, mounted read-only (ReadOnlyMany "
        "for pods on several nodes) [default: NAME-repository].", show_default=False)] = None,
    claim_path: Annotated[str, typer.Option(
        help="The repository's folder inside the claim [default: its root].",
        show_default=False)] = "",
    host_path: Annotated[str | None, typer.Option(
        help="Instead of a claim: the repository's folder on every GPU node.",
        show_default=False)] = None,
    gpu_product: Annotated[str | None, typer.Option(
        help="Value of the nvidia.com/gpu.product node label to schedule on (or the NVML "
        "device name, which becomes it) [default: the GPU profile's gpu.product].",
        show_default=False)] = None,
    cpu: Annotated[float | None, typer.Option(
        help="CPU cores per pod [default: one per process the pod runs].",
        show_default=False)] = None,
    memory_gib: Annotated[float | None, typer.Option(
        help="Memory per pod in GiB [default: /dev/shm + the engines + an allowance per "
        "process].", show_default=False)] = None,
    hpa: Annotated[bool, typer.Option(
        help="Also a HorizontalPodAutoscaler on Triton's nv_inference_pending_request_count "
        "(needs a custom metrics adapter, e.g. prometheus-adapter).")] = False,
    max_replicas: Annotated[int | None, typer.Option(
        help="The autoscaler's maximum pods [default: four].", show_default=False)] = None,
    target_pending: Annotated[float | None, typer.Option(
        help="The autoscaler's target: requests queued per pod, on average [default: two].",
        show_default=False)] = None,
    api_key_secret: Annotated[str | None, typer.Option(
        help="Secret whose key `api-key` the gateway asks clients for (optional: without the "
        "Secret, no key) [default: NAME-api-key].", show_default=False)] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write Kubernetes manifests that serve a trt repository with `qvl-trt serve`: a
    Deployment on the repository's GPU (its world size in GPUs, /dev/shm, CPU and memory from
    the repository, probes on serve's /ready and /live), a Service, a PodDisruptionBudget and
    optionally an autoscaler. Prints the `kubectl apply` line."""
    from .console import out as console
    from .deploy.kubernetes import DeployOptions, write_manifests

    given = {"name": name, "replicas": replicas, "openai_port": openai_port,
             "health_port": health_port, "max_replicas": max_replicas,
             "target_pending": target_pending}
    opts = DeployOptions(
        image=image, namespace=namespace, mount_path=mount_path, claim=claim,
        claim_path=claim_path, host_path=host_path, gpu_product=gpu_product, cpu=cpu,
        memory_gib=memory_gib, hpa=hpa, api_key_secret=api_key_secret,
        **{k: v for k, v in given.items() if v is not None})
    result = write_manifests(repo, out, opts, force=force)
    needs = result.needs
    console.print(f"wrote {', '.join(result.files)} into {result.out}", highlight=False)
    for note in needs.notes:
        console.print(f"  {note}", highlight=False, markup=False)
    where = f"the claim {result.claim}" if result.claim else f"the node folder {host_path}"
    console.print(f"the pods mount {where} at {needs.mount_path} (it must hold the "
                  f"repository{f' under {claim_path}' if claim_path else ''}); the gateway's "
                  f"key, if any, comes from the Secret {result.secret} (kubectl create secret "
                  f"generic {result.secret} --from-file=api-key=KEYFILE)",
                  highlight=False, markup=False, soft_wrap=True)
    console.print(f"apply them with: {result.apply_command}", highlight=False, markup=False,
                  soft_wrap=True)


@command(panel="Serve and measure")
def gateway(
    url: Annotated[str, typer.Option(help="Triton's gRPC endpoint: grpc://HOST:PORT.")]
    = "grpc://127.0.0.1:8001",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9000,
    max_concurrency: Annotated[int, typer.Option(
        help="Chat requests in flight; more get 429.")] = 256,
    max_body_bytes: Annotated[int | None, typer.Option(
        help="Largest request body; larger get 413 [default: the deployment's "
        "max_request_bytes + 64 KiB].", show_default=False)] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        help="Seconds the answers in flight get to finish after SIGTERM.")] = 10.0,
) -> None:
    """OpenAI-compatible endpoint and chat page in front of a running Triton (`qvl-trt serve`,
    or the container): POST /v1/chat/completions, GET /v1/models, the chat page at /, /ready,
    /live and /metrics. With the environment variable QVL_TRT_API_KEY set, /v1/ asks for that
    key (Authorization: Bearer KEY). Stops on Ctrl-C or SIGTERM."""
    from .client.generate import parse_url
    from .console import out as console
    from .gateway.app import API_KEY_ENV, GatewayOptions, run_gateway
    from .triton.server import client_host

    endpoint = parse_url(url)
    if endpoint.protocol != "grpc":
        raise ConfigError(f"--url {url}: the gateway talks to Triton over gRPC; pass "
                          "grpc://HOST:PORT (Triton's --grpc-port, 8001 by default)")
    opts = GatewayOptions(endpoint.address, host=host, port=port,
                          max_concurrency=max_concurrency, max_body_bytes=max_body_bytes,
                          shutdown_timeout_s=shutdown_timeout,
                          api_key=os.environ.get(API_KEY_ENV))
    shown = f"http://{client_host(host)}:{port}"
    run_gateway(opts, on_ready=lambda: console.print(
        f"gateway listening: OpenAI endpoint {shown}/v1, chat page {shown}/ (Triton gRPC "
        f"{endpoint.address}); Ctrl-C stops it", highlight=False))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
