"""Commands of the "Build" panel: plan, build (and its single steps) and write the
repository."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ..dtypes import Dtype, WeightOnly
from ..errors import ConfigError
from ..profiles import TrtEdition
from ..triton.options import BuildInput, Flavor, RepoOptions
from ..workload import Workload
from .app import (
    WEIGHTS_HELP,
    WORKLOAD_HELP,
    JsonOpt,
    ModelOpt,
    WeightsOpt,
    command,
    per_model,
)


@command(panel="Build")
def plan(
    model: Annotated[list[str], typer.Option(
        "--model", "-m", help="Hugging Face Qwen3-VL checkpoint folder (a config.json is "
        "enough), or NAME=FOLDER; repeat to plan several models served together on one card.",
        show_default=False)],
    gpu: Annotated[str, typer.Option(
        "--gpu", "-g", help="GPU profile name (see `qvl-trt gpus`), path to a profile .toml, "
        "or `all`: one row per shipped profile (exit 0 whatever fits).")],
    weights: Annotated[list[WeightOnly] | None, typer.Option(
        help="Language-model weights as `build --weights` stores them: none (the model "
        "dtype), int8 or int4 (weight-only). Once for every --model or once per --model "
        "[default: none; with --gpu all and one model: a column per precision].")] = None,
    workload: Annotated[list[Workload] | None, typer.Option(
        help=f"{WORKLOAD_HELP} Once for every --model or once per --model: `-m chat=CKPT -m "
        "video=CKPT --workload chat --workload video` plans two builds of one checkpoint "
        "that one endpoint serves [default: chat].", show_default=False)] = None,
    save_profiles: Annotated[Path | None, typer.Option(
        help="Folder to write each model's profile with the limits of this plan into "
        "(GPU-NAME.toml, NAME: the model's name or folder), for `qvl-trt build --gpu`: how "
        "models planned onto one card are built for it.", show_default=False)] = None,
    tp_size: Annotated[int, typer.Option(
        help="Tensor-parallel size, as `build --tp-size`: each rank on its own card of the "
        "profile; the figures are for the most loaded card, rank 0's, which also runs the "
        "vision model. One --model only.")] = 1,
    json_out: JsonOpt = False,
) -> None:
    """Check that checkpoints fit a GPU profile: weights, KV cache, prompt table, capacity,
    and the limits lowered for them where the profile's do not fit."""
    from ..checkpoint import open_checkpoint
    from ..profiles import load_profile

    named = [BuildInput.parse(m) for m in model]
    precisions = per_model(weights, len(named), "--weights", WeightOnly.NONE)
    workloads = per_model(workload, len(named), "--workload", Workload.CHAT)
    every_card = gpu.strip().lower() == "all"
    _check_plan_options(len(named), every_card, tp_size, save_profiles)
    ckpts = [open_checkpoint(m.path) for m in named]
    if every_card:
        _plan_every_card(ckpts[0], weights[0] if weights else None, tp_size, workloads[0],
                         json_out)
        return
    profile = load_profile(gpu)
    names = [m.name or m.path.resolve().name for m in named]
    plans = _plan_on_card(list(zip(names, ckpts, precisions, workloads, strict=True)),
                          profile, tp_size, json_out)
    if save_profiles:
        _save_profiles(save_profiles, profile, named, plans, tp_size, json_out)


def _check_plan_options(models: int, every_card: bool, tp_size: int,
                        save_profiles: Path | None) -> None:
    if tp_size != 1 and models > 1:
        raise ConfigError("--tp-size plans one --model across its own cards; plan models "
                          "that share a card with --tp-size 1")
    if every_card and (save_profiles or models > 1):
        raise ConfigError("--gpu all plans one --model on every card; to plan several "
                          "models onto one card or save profiles, name the card: --gpu 4090d")


def _plan_on_card(models: list, profile, tp_size: int, json_out: bool) -> list:
    """One model's plan (at `tp_size`) or several planned together onto the card, printed;
    PlanError where they do not fit."""
    from ..plan import check_fits, check_fits_together, make_plan, plan_together
    from .console import (
        lowered_lines,
        out,
        plan_json,
        plan_table,
        print_json,
        shared_plan_json,
        shared_plan_table,
    )

    if len(models) == 1:
        _, ckpt, weights, workload = models[0]
        plan = make_plan(ckpt, profile, weights, tp_size, workload)
        if json_out:
            print_json(plan_json(plan))
        else:
            out.print(plan_table(plan, profile))
            for line in lowered_lines(plan):
                out.print(line, markup=False, highlight=False)
        check_fits(plan)
        return [plan]
    shared = plan_together(models, profile)
    if json_out:
        print_json(shared_plan_json(shared, profile))
    elif shared.fits:
        out.print(shared_plan_table(shared, profile))
        for n, p in zip(shared.names, shared.plans, strict=True):
            for line in lowered_lines(p):
                out.print(f"{n}: {line}", markup=False, highlight=False)
    check_fits_together(shared)
    return list(shared.plans)


def _save_profiles(folder: Path, profile, named: list[BuildInput], plans: list, tp_size: int,
                   json_out: bool) -> None:
    """Write each plan's profile and say how to build from it."""
    from ..plan import save_planned_profiles
    from .console import err, out

    written = save_planned_profiles(folder, profile, [
        (m.name or m.path.resolve().name, p) for m, p in zip(named, plans, strict=True)])
    tp = f" --tp-size {tp_size}" if tp_size != 1 else ""
    for m, p, path in zip(named, plans, written, strict=True):
        (err if json_out else out).print(
            f"wrote {path}; build with: qvl-trt build --model {m.path} --gpu {path} "
            f"--weights {p.weights.value} --workload {p.workload}{tp}", markup=False,
            highlight=False, soft_wrap=True)


def _plan_every_card(ckpt, weights: WeightOnly | None, tp_size: int, workload: Workload,
                     json_out: bool) -> None:
    """`plan --gpu all`: every precision side by side, or one in detail."""
    from ..plan import plan_every_precision, plan_every_profile
    from .console import (
        out,
        plan_all_notes,
        plan_all_table,
        plan_json,
        plan_precision_table,
        print_json,
    )

    if weights is None:
        table = plan_every_precision(ckpt, tp_size, workload)
        if json_out:
            print_json([plan_json(p) for _, plans in table for p in plans.values()])
        else:
            out.print(plan_precision_table(table))
        return
    rows = plan_every_profile(ckpt, weights, tp_size, workload)
    if json_out:
        print_json([plan_json(p) for _, p in rows])
        return
    out.print(plan_all_table(rows))
    for note in plan_all_notes(rows):
        out.print(note, markup=False, highlight=False)


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
            "--out", "-o", help="Build folder [default: build/GPU, with .WEIGHTS for int8 "
            "or int4 weights and .WORKLOAD for video or long: build/h200.int8.video]."
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
    weights: Annotated[WeightOnly | None, typer.Option(
        help=f"{WEIGHTS_HELP} With --resume: checked against the build's [default: none].",
        show_default=False)] = None,
    workload: Annotated[Workload | None, typer.Option(
        help=f"{WORKLOAD_HELP} With --resume: checked against the build's [default: chat].",
        show_default=False)] = None,
    force: Annotated[
        bool, typer.Option(help="Rebuild stages whose inputs did not change.")
    ] = False,
) -> None:
    """Build engines and the Triton repository: inspect -> plan -> vision -> llm_checkpoint ->
    llm -> repo -> manifest. Unchanged stages are skipped; exit code 3 means a stage needs
    another machine (the message says which command finishes it)."""
    from ..build import Stage, resume_build, run_build
    from .console import build_line
    from .console import out as console

    started = time.perf_counter()
    stages = Stage.parse_list(only) if only else None
    if resume:
        if model or gpu:
            raise ConfigError(
                "--resume takes its options from the manifest; drop --model and --gpu"
            )
        result = resume_build(resume, only=stages, force=force, weights=weights,
                              workload=workload)
    else:
        if model is None or gpu is None:
            raise ConfigError("build needs --model and --gpu (or --resume DIR)")
        options, default_out = _new_build(model, gpu, trt_edition, vision_dtype, tp_size,
                                          weights or WeightOnly.NONE, workload or Workload.CHAT)
        result = run_build(options, out or default_out, only=stages, force=force)
    console.print(build_line(result, time.perf_counter() - started))


def _new_build(model: Path, gpu: str, trt_edition: TrtEdition | None, vision_dtype: Dtype,
               tp_size: int, weights: WeightOnly, workload: Workload):
    """The options of a new build and its default folder (build/NAME)."""
    from ..build import BuildOptions
    from ..manifest import build_name
    from ..profiles import profile_argument

    options = BuildOptions(model=str(model.resolve()), gpu=profile_argument(gpu),
                           trt_edition=trt_edition, vision_dtype=vision_dtype, tp_size=tp_size,
                           weights=weights, workload=workload)
    return options, Path("build") / build_name(Path(gpu).stem, weights, workload)


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
    weights: WeightsOpt = WeightOnly.NONE,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Convert the language model of an HF Qwen3-VL checkpoint into a TensorRT-LLM checkpoint
    (config.json + rank{N}.safetensors), streaming one tensor at a time."""
    from ..llm.convert import convert_checkpoint, resolve_max_seq_len
    from .console import out as console
    from .console import print_json

    result = convert_checkpoint(model, out, max_seq_len=resolve_max_seq_len(gpu, max_seq_len),
                                dtype=dtype, tp_size=tp_size, weights=weights, force=force)
    if json_out:
        print_json({"out": str(result.out), "rank_files": result.rank_files,
                    "total_bytes": result.total_bytes, "seconds": round(result.seconds, 3),
                    "config": result.config})
        return
    console.print(f"converted {model} -> {result.out}: {result.config.dtype}, weights "
                  f"{result.config.weight_only}, TP "
                  f"{result.config.tp_size}, max_position_embeddings "
                  f"{result.config.max_position_embeddings}, "
                  f"{result.total_bytes / 2**30:.2f} GiB in {result.seconds:.1f} s")


@command(panel="Build")
def matrix(
    model: ModelOpt,
    gpus: Annotated[str, typer.Option(help="`all`, or comma-separated profile names or "
                                      ".toml paths.")] = "all",
    weights: Annotated[str, typer.Option(help="Comma-separated language-model weights, as "
                                         "`build --weights` takes them: none, int8, int4; a "
                                         "job per profile and precision.")] = "none",
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads, as `build "
                                           "--workload` takes them: chat, video, long; a job "
                                           "per profile, precision and workload.")] = "chat",
    build_root: Annotated[str, typer.Option(help="Folder holding one build folder per "
                                            "profile, precision and workload.")] = "build",
) -> None:
    """Print a CI job matrix as JSON: one job per GPU profile and weight precision with runner
    labels by compute capability, container image and the build's cache key (computed
    without building). A pair whose checkpoint does not fit the card is left out, with the
    reason on stderr. GitHub Actions: `strategy.matrix: ${{ fromJSON(...) }}`; see
    .github/workflows/engines.yml."""
    import json

    from ..build.matrix import ci_matrix
    from .console import err

    result = ci_matrix(model, gpus, WeightOnly.parse_list(weights),
                       Workload.parse_list(workloads), build_root=build_root)
    for line in result.left_out:
        err.print(f"left out of the matrix: {line}", markup=False, highlight=False,
                  soft_wrap=True)
    typer.echo(json.dumps(result.to_json(), indent=2))


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
        "ONNX Attention op (opset 23), tensorrt as MatMul-Softmax-MatMul (opset 18; the "
        "container's TensorRT 10.14 parses the Attention op, not yet tried on a GPU).")] = (
            TrtEdition.TENSORRT_RTX),
) -> None:
    """Export the vision tower to ONNX with a dynamic patch count, then check it against the
    Hugging Face tower: one line per output with the max difference and PASS/FAIL."""
    from ..checkpoint import open_checkpoint
    from ..vision.validate import export_and_validate
    from .console import out as console

    onnx, validation = export_and_validate(
        open_checkpoint(model), out or Path("build") / f"vision-onnx-{dtype}", dtype=dtype,
        edition=trt_edition)
    console.print(f"validation vs Hugging Face ({validation.graph}):", highlight=False)
    for line in validation.lines():
        console.print(f"  {line}", highlight=False)
    validation.raise_if_failed()
    console.print(f"exported {onnx.path} ({dtype}, opset {onnx.opset}, dynamic "
                  f"num_patches) in {onnx.seconds:.1f} s", highlight=False)


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
        "and reference decoder (any machine, CPU included).")] = RepoOptions.flavor,
    mount_path: Annotated[str | None, typer.Option(
        help="Where the repository will be mounted when served (the tensorrtllm backend takes "
        "an absolute engine path) [default: --out].")] = None,
    default_max_tokens: Annotated[int, typer.Option(
        help="max_tokens of requests that give none.")] = RepoOptions.default_max_tokens,
    vision_cache_mib: Annotated[int, typer.Option(
        help="Size of the vision encoder's cache of image embeddings.")]
    = RepoOptions.vision_cache_mib,
    allow_image_host: Annotated[list[str] | None, typer.Option(
        help="Host whose http(s) image URLs the server may fetch (repeatable) [default: none, "
        "images come as data URIs or bytes].")] = None,
    postprocessing_instances: Annotated[int | None, typer.Option(
        min=1, help="Instances of postprocessing and tensorrt_llm_bls, which turn the "
        "engine's tokens into streamed text [default: one per 4 cores of this machine, 1 to "
        "4].")] = None,
    max_queue: Annotated[int | None, typer.Option(
        min=0, help="Requests that may wait for a batch slot of a build's tensorrt_llm beyond "
        "its max_batch_size running ones; more are refused at once as busy (HTTP 429 through "
        "the gateway) [default: 4 x max_batch_size].", show_default=False)] = None,
    max_queue_wait: Annotated[float, typer.Option(
        min=0, help="Seconds a request may wait for a batch slot before it is refused the "
        "same way (0: as long as it takes).")] = RepoOptions.max_queue_wait_s,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write a Triton model repository from one or more build folders."""
    from ..triton.repository import write_repo
    from .console import out as console

    counts = {} if postprocessing_instances is None else {
        "postprocessing_instances": postprocessing_instances}
    options = RepoOptions(flavor=flavor, mount_path=mount_path,
                          default_max_tokens=default_max_tokens,
                          vision_cache_mib=vision_cache_mib,
                          image_url_allow_list=tuple(allow_image_host or ()),
                          max_queue=max_queue, max_queue_wait_s=max_queue_wait, **counts)
    result = write_repo([BuildInput.parse(b) for b in build], out, options, force=force)
    ensembles = ", ".join(b.names.ensemble for b in result.builds)
    console.print(f"wrote the {flavor.value} repository {result.path}: {len(result.models)} "
                  f"models; ensemble{'s' if len(result.builds) > 1 else ''}: {ensembles}")
    if flavor is Flavor.TRT:
        console.print("write its serving image recipe (the TensorRT-LLM container plus what "
                      f"its models import) with: qvl-trt image --repo {result.path} --out "
                      f"{result.path.parent / 'image'}", highlight=False, markup=False,
                      soft_wrap=True)
