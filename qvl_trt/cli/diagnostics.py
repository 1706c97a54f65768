"""Commands of the "Inspect and debug" panel: what this machine, a checkpoint or a
repository holds, and the pipeline's steps one at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import (
    JsonOpt,
    ModelOpt,
    VideoFpsOpt,
    VideoOpt,
    command,
    read_media,
)


@command(panel="Inspect and debug")
def gpus(json_out: JsonOpt = False) -> None:
    """List the shipped GPU profiles and their build limits."""
    from ..profiles import load_profile, profile_names
    from .console import gpus_table, out, print_json

    profiles = [load_profile(n) for n in profile_names()]
    if json_out:
        print_json(profiles)
    else:
        out.print(gpus_table(profiles))


@command(panel="Inspect and debug")
def inspect(model: ModelOpt, json_out: JsonOpt = False) -> None:
    """Describe a checkpoint: variant, dimensions, parameters, files."""
    from ..checkpoint import open_checkpoint
    from .console import inspect_lines, out, print_json

    summary = open_checkpoint(model).summary()
    if json_out:
        print_json(summary)
        return
    for line in inspect_lines(summary):
        out.print(line)


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
    from ..machine import environment_report
    from ..typed_config import to_jsonable
    from .console import doctor_tables, out, print_json, serve_checks_table

    report = environment_report()
    readiness = ()
    if repo is not None:
        from ..serve.needs import read_needs, serve_checks

        readiness = serve_checks(read_needs(repo), load_models=load)
    if json_out:
        print_json({**to_jsonable(report), "serve_checks": to_jsonable(readiness)})
    else:
        for table in doctor_tables(report):
            out.print(table)
        if readiness:
            out.print(serve_checks_table(repo, readiness))
    if not all(r.ok for r in readiness):
        raise typer.Exit(1)


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
    docs/build.md): pixel values, grids, input ids before and after fake-id substitution,
    position ids, MRoPE table and delta, vision index inputs."""
    from ..mm.request import prepare_files
    from ..profiles import profile_argument
    from .console import out as console

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
    from ..chat_messages import VideoFile
    from ..llm.pipeline import ReferencePipeline, sampling_params
    from .console import print_generation, print_piece, print_token_json

    images, video_files = read_media(image, video)
    videos = [VideoFile(data, video_fps) for data in video_files]
    sampling = sampling_params(model, max_tokens=max_tokens, greedy=greedy,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    pipeline = ReferencePipeline.load(model, checkpoint=checkpoint, device=device,
                                      max_seq_len=max_seq_len)
    show = print_token_json if json_out else print_piece
    result = pipeline.ask(prompt, images, sampling=sampling, on_text=show if stream else None,
                          videos=videos)
    print_generation(result, json_out=json_out, streamed=stream, videos=bool(videos))


@command(panel="Inspect and debug")
def validate(
    repository: Annotated[Path, typer.Argument(help="Model repository folder.",
                                               show_default=False)],
    json_out: JsonOpt = False,
) -> None:
    """Check a model repository: configs parse, ensemble maps agree with the models (name,
    dtype, dims), engines exist and match the GPU profile and TensorRT edition. Exit 1 on any
    problem."""
    from ..triton.validate import validate_repo
    from .console import out as console
    from .console import print_json, validate_json, validate_lines

    report = validate_repo(repository)
    if json_out:
        print_json(validate_json(report))
    else:
        for line in validate_lines(report):
            console.print(line, highlight=False)
    if not report.ok:
        raise typer.Exit(1)
