"""Rich rendering of the objects commands return. Library code never prints; the CLI hands
results to these functions."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from ..client.metrics import (
    output_token_throughput_per_user,
    request_latency,
    time_to_first_token,
)
from ..dtypes import WeightOnly
from ..machine import Report
from ..plan import GIB, Plan, SharedPlan, TypicalRequest, workload_typical
from ..profiles import GpuProfile
from ..typed_config import to_jsonable
from ..workload import Workload

if TYPE_CHECKING:
    from pathlib import Path

    from ..build import BuildResult
    from ..client.bench import BenchReport, BenchSettings, Measurement
    from ..client.generate import Response
    from ..client.metrics import LevelMetrics, RequestRecord
    from ..client.verify import CaseResult
    from ..deploy.image import ImageRecipe
    from ..deploy.kubernetes import DeployResult
    from ..gateway.options import GatewayOptions
    from ..gateway.tenants import KeyEntry, KeyRing
    from ..llm.pipeline import GenerationOutput, TextDelta
    from ..serve.gateway_process import GatewayProcess
    from ..serve.needs import ServeCheck
    from ..serve.server import TritonServer
    from ..triton.validation_report import ValidationReport

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def setup_logging(verbose: int) -> None:
    """Stage progress at INFO by default; -v adds DEBUG from qvl_trt, -vv from everything."""
    level = logging.DEBUG if verbose else logging.INFO
    handler = RichHandler(
        console=err,
        show_path=verbose > 0,
        show_time=verbose > 0,
        markup=False,
        rich_tracebacks=False,
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)
    logging.getLogger("qvl_trt").setLevel(level)


def print_json(value: Any) -> None:
    out.print_json(json.dumps(to_jsonable(value)))


def print_text(text: str, *, end: str = "\n") -> None:
    """A model's text as it is: no markup, no highlighting."""
    out.print(text, end=end, markup=False, highlight=False)


def print_piece(piece: Response | TextDelta) -> None:
    """A piece of an answer as it streams in (infer's responses, generate's tokens)."""
    print_text(piece.text, end="")


def print_token_json(delta: TextDelta) -> None:
    """`generate --stream --json`: a JSON line per token as it comes."""
    typer.echo(json.dumps({"token_id": delta.token_id, "text": delta.text}))


def print_generation(result: GenerationOutput, *, json_out: bool, streamed: bool,
                     videos: bool) -> None:
    """generate's answer once it is complete: as JSON (one line after streamed token lines),
    else its text (unless streamed already) and a line of token counts."""
    if json_out:
        summary = {"text": result.text, "token_ids": list(result.token_ids),
                   "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                   "image_tokens": result.image_tokens,
                   "completion_tokens": result.completion_tokens}
        typer.echo(json.dumps(summary)) if streamed else print_json(summary)
        return
    print_text("" if streamed else result.text)
    out.print(f"[dim]{result.completion_tokens} tokens ({result.finish_reason.value}); "
              f"prompt {result.prompt_tokens} tokens, {result.image_tokens} of them for "
              f"{'images and videos' if videos else 'images'}[/dim]")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _copy_ms(copy_bytes: int, profile: GpuProfile) -> float:
    """A device-to-device copy reads and writes every byte once."""
    return 2 * copy_bytes / (profile.gpu.memory_bandwidth_gbs * 1e9) * 1e3


def _copy_basis(plan: Plan, profile: GpuProfile) -> str:
    typical = workload_typical(plan)
    return (
        f"device to device on every step (context and generation), every slot at the cap: "
        f"~{_copy_ms(plan.prompt_table_copy_bytes_per_step, profile):.2f} ms at "
        f"{profile.gpu.memory_bandwidth_gbs:g} GB/s, {plan.table_copy_share_of_weights:.0%} of "
        f"the decode step's weight read, {plan.table_copy_share_of_step:.0%} of all it reads "
        f"(weights and KV at the caps); with the KV cache full of {typical.media}s: "
        f"{_gib(plan.prompt_table_copy_bytes_typical)}, "
        f"~{_copy_ms(plan.prompt_table_copy_bytes_typical, profile):.2f} ms")


def _element_basis(plan: Plan) -> str:
    bound = plan.prompt_table_element_bound
    if bound is not None:
        return f"at most {bound:,} through lookup_plugin (32-bit indexing)"
    if plan.workload is Workload.CHAT:
        return ("below 2^31 elements, the chat workload's bound (TensorRT's limit through "
                "10.10; the container's 10.14 takes more, as --workload video does)")
    return ("no element bound: the container's TensorRT takes inputs above 2^31 "
            "elements (10.11 on) and the lookup is no lookup_plugin")


def _precision(weights: WeightOnly) -> str:
    """How a plan's LLM weights are stored, in a column or title."""
    return "fp16" if weights is WeightOnly.NONE else weights.value


def _llm_weights_basis(weights: WeightOnly) -> str:
    if weights is WeightOnly.NONE:
        return "parameters x 2 bytes, lm_head kept apart from the embedding"
    return (f"decoder linears {weights.bits}-bit + one fp16 scale per output channel; "
            "embedding, lm_head (apart) and norms fp16")


def _tp_title(plan: Plan) -> str:
    return "" if plan.tp_size == 1 else (
        f", tensor-parallel size {plan.tp_size}: rank 0's card, which also runs the vision "
        "model")


def plan_table(plan: Plan, profile: GpuProfile) -> Table:
    lim = plan.limits
    t = Table(
        title=f"plan: {plan.variant} checkpoint, {_precision(plan.weights)} weights, "
        f"{plan.workload} workload, on "
        f"{profile.name} ({profile.gpu.description}, {profile.gpu.memory_mib} MiB)"
        f"{_tp_title(plan)}"
    )
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_column("basis")
    rows = [
        ("vision weights (fp16)", _gib(plan.vision_weight_bytes), "parameters x 2 bytes"),
        (
            f"LLM weights ({_precision(plan.weights)})",
            _gib(plan.llm_weight_bytes),
            _llm_weights_basis(plan.weights),
        ),
        (
            "vision activations",
            _gib(plan.vision_activation_bytes),
            f"estimate at {lim.vision_max_pixels} pixels per image",
        ),
        (
            "LLM activations",
            _gib(plan.llm_activation_bytes),
            f"estimate at max_num_tokens {lim.max_num_tokens}",
        ),
        ("runtime overhead", _gib(plan.runtime_overhead_bytes), "CUDA contexts, workspaces"),
        (
            "prompt table",
            _gib(plan.prompt_table_bytes),
            f"{plan.prompt_table_rows:,} rows = batch {lim.max_batch_size} x (1+DeepStack) x "
            f"{lim.max_visual_tokens_per_request} visual tokens per request; "
            f"{plan.prompt_table_elements:,} elements, {_element_basis(plan)}",
        ),
        (
            "table rows per request",
            f"{plan.prompt_table_rows_per_request:,}",
            "the runtime's cap: table rows / max_batch_size",
        ),
        (
            "table copy per step",
            _gib(plan.prompt_table_copy_bytes_per_step),
            _copy_basis(plan, profile),
        ),
        (
            "MRoPE tables",
            _gib(plan.mrope_table_bytes),
            f"{plan.mrope_table_bytes_per_request / 2**20:.1f} MiB per request (fp32 cos/sin "
            f"at max_seq_len {lim.max_seq_len}) x batch; copied whole at every context chunk",
        ),
        (
            "shared memory",
            _gib(plan.shm_bytes),
            "/dev/shm for a full batch at the caps (pixels, MRoPE and prompt tables cross it "
            "between models); a container needs --shm-size this large or --ipc=host",
        ),
        (
            "KV bytes per token",
            f"{plan.kv_bytes_per_token:,}",
            "2 x layers x kv_heads x head_dim x 2 bytes"
            + ("" if plan.tp_size == 1 else f", kv_heads / {plan.tp_size} a rank"),
        ),
        (
            "KV cache",
            _gib(plan.kv_cache_bytes),
            f"{lim.kv_cache_free_gpu_mem_fraction:g} of what is left",
        ),
        (
            "KV budget",
            f"{plan.kv_capacity_tokens:,} tokens",
            f"max_tokens_in_paged_kv_cache alone on the card, blocks of {lim.tokens_per_block}",
        ),
        (
            "full-length sequences",
            str(plan.full_sequences),
            f"max_seq_len {lim.max_seq_len} sequences at once "
            f"({_gib(lim.max_seq_len * plan.kv_bytes_per_token)} of KV each); prompts up to "
            f"max_seq_len - 1 in chunks of max_num_tokens {lim.max_num_tokens} "
            "(chunked context)",
        ),
        (
            "typical requests at once",
            str(plan.concurrent_typical_requests),
            _typical(plan.typical_request),
        ),
        (
            "typical videos at once",
            str(plan.concurrent_typical_videos),
            _typical(plan.typical_video),
        ),
    ]
    for row in rows:
        t.add_row(*row)
    return t


def _typical(request: TypicalRequest) -> str:
    what = (f"{request.media} ({request.visual_tokens} tokens) + {request.text_tokens} text + "
            f"{request.output_tokens} out")
    return f"{what}: refused, {request.refused}" if request.refused else what


def lowered_lines(plan: Plan) -> list[str]:
    """The limits the workload set and those the plan lowered below them, and why (empty
    when none)."""
    lines = []
    if plan.raised:
        changes = ", ".join(f"{c.key} {c.profile_value} -> {c.value}" for c in plan.raised)
        lines.append(f"{plan.workload} workload: {changes} (the profile's -> the workload's)")
    if not plan.lowered:
        return lines
    changes = ", ".join(f"{c.key} {c.profile_value} -> {c.value}" for c in plan.lowered)
    why = f" ({plan.lowered_because} at the next larger limits)" if plan.lowered_because else ""
    if not plan.fits:
        return [*lines, f"limits lowered as far as they go for this checkpoint{why}: {changes}"]
    return [*lines, f"limits lowered for this checkpoint{why}: {changes}; the build uses them"]


def plan_all_table(rows: list[tuple[GpuProfile, Plan]]) -> Table:
    """One row per profile: does the checkpoint fit, and how much it serves there (the
    reasons for a "no" are plan_all_notes, printed unwrapped below the table)."""
    variant = rows[0][1].variant if rows else "?"
    weights = _precision(rows[0][1].weights) if rows else "?"
    workload = rows[0][1].workload if rows else "?"
    t = Table(title=f"plan: {variant} checkpoint, {weights} weights, {workload} workload, on "
              f"every shipped GPU profile{_tp_title(rows[0][1]) if rows else ''}")
    t.caption = ("images, videos: typical requests (a 1920x1080 image, a 30-frame 1280x720 "
                 "clip) the KV cache holds at once; clip: its visual tokens as the profile "
                 "admits it (- refused); context: max_seq_len")
    for col in ("profile", "MiB", "fits", "batch", "images", "videos", "clip", "context",
                "KV budget"):
        t.add_column(col, justify="left" if col in ("profile", "fits") else "right",
                     no_wrap=True)
    for profile, plan in rows:
        t.add_row(
            profile.name,
            str(profile.gpu.memory_mib),
            "yes" if plan.fits else "[red]no[/red]",
            str(plan.limits.max_batch_size),
            str(plan.concurrent_typical_requests),
            str(plan.concurrent_typical_videos),
            "-" if plan.typical_video.refused else str(plan.typical_video.visual_tokens),
            str(plan.limits.max_seq_len),
            f"{plan.kv_capacity_tokens:,}",
        )
    return t


def plan_all_notes(rows: list[tuple[GpuProfile, Plan]]) -> list[str]:
    """For each profile the checkpoint does not fit: why, and the fix."""
    return [f"{profile.name}: {plan.problems[0]}" for profile, plan in rows if plan.problems]


def precision_cell(plan: Plan) -> str:
    """One card in one precision: `-` when it does not fit, else the batch (with `*` when
    the plan lowered the profile's limits) and the KV budget in tokens."""
    if not plan.fits:
        return "-"
    star = "*" if plan.lowered else ""
    return f"{plan.limits.max_batch_size}{star} / {plan.kv_capacity_tokens:,}"


def plan_precision_table(rows: list[tuple[GpuProfile, dict[WeightOnly, Plan]]]) -> Table:
    """One row per profile, a column per weight precision: which card takes the checkpoint
    in which precision."""
    first = next(iter(rows[0][1].values())) if rows else None
    variant = first.variant if first else "?"
    t = Table(title=f"plan: {variant} checkpoint on every shipped GPU profile, by weight "
              f"precision{_tp_title(first) if first else ''}")
    t.caption = ("each cell: max_batch_size / KV budget in tokens (max_tokens_in_paged_kv_cache);"
                 " - does not fit; * limits lowered below the profile's (`qvl-trt plan --gpu "
                 "NAME --weights W` says which)")
    t.add_column("profile", no_wrap=True)
    t.add_column("MiB", justify="right", no_wrap=True)
    for w in WeightOnly:
        t.add_column(_precision(w), justify="right", no_wrap=True)
    for profile, plans in rows:
        t.add_row(profile.name, str(profile.gpu.memory_mib),
                  *(precision_cell(plans[w]) for w in WeightOnly))
    return t


def plan_json(plan: Plan) -> dict[str, Any]:
    return {**to_jsonable(plan), "fits": plan.fits, "resident_bytes": plan.resident_bytes}


def shared_plan_json(shared: SharedPlan, profile: GpuProfile) -> dict[str, Any]:
    return {"profile": profile.name, "fits": shared.fits, "problems": list(shared.problems),
            "builds": [{"name": name, "kv_budget_tokens": kv, "concurrent_typical_requests": n,
                        **plan_json(plan)} for name, plan, kv, n in zip(
                            shared.names, shared.plans, shared.kv_budgets,
                            shared.concurrent_typical_requests, strict=True)]}


def shared_plan_table(shared: SharedPlan, profile: GpuProfile) -> Table:
    """Several builds on one card: each one's share and KV budget."""
    t = Table(title=f"plan: {' + '.join(shared.names)} on one {profile.name} "
              f"({profile.gpu.description}, {profile.gpu.memory_mib} MiB)")
    t.caption = ("resident: weights, activations, prompt and MRoPE tables, runtime overhead; "
                 "KV cache: its share of what is left, in tokens (max_tokens_in_paged_kv_cache) "
                 "and bytes; images: typical requests it holds at once; context: max_seq_len")
    for col in ("model", "weights", "batch", "context", "resident", "KV tokens", "KV cache",
                "images"):
        t.add_column(col, justify="left" if col in ("model", "weights") else "right",
                     no_wrap=True)
    for name, plan, kv, images in zip(shared.names, shared.plans, shared.kv_budgets,
                                      shared.concurrent_typical_requests, strict=True):
        t.add_row(f"{name} ({plan.variant})", _precision(plan.weights),
                  str(plan.limits.max_batch_size), str(plan.limits.max_seq_len),
                  _gib(plan.fixed_bytes), f"{kv:,}", _gib(kv * plan.kv_bytes_per_token),
                  str(images))
    kv_bytes = sum(kv * p.kv_bytes_per_token
                   for kv, p in zip(shared.kv_budgets, shared.plans, strict=True))
    t.add_row("together", "", "", "", _gib(shared.fixed_bytes), "", _gib(kv_bytes), "")
    return t


def gpus_table(profiles: list[GpuProfile]) -> Table:
    t = Table(title="GPU profiles")
    for col in (
        "name",
        "GPU",
        "CC",
        "MiB",
        "GB/s",
        "fp16 TFLOPs",
        "vision edition",
        "batch",
        "max_seq_len",
        "max pixels",
        "images",
    ):
        t.add_column(col)
    for p in profiles:
        g, lim = p.gpu, p.limits
        t.add_row(
            p.name,
            g.description,
            g.compute_capability,
            str(g.memory_mib),
            f"{g.memory_bandwidth_gbs:g}",
            f"{g.fp16_tensor_tflops:g}",
            g.trt_edition.value,
            str(lim.max_batch_size),
            str(lim.max_seq_len),
            str(lim.vision_max_pixels),
            str(lim.max_images_per_request),
        )
    return t


def doctor_tables(report: Report) -> list[Table]:
    env = Table(title=f"qvl-trt {report.qvl_trt} on Python {report.python}, {report.platform}")
    env.add_column("component")
    env.add_column("version / location")
    for key, version in report.packages.items():
        env.add_row(key, version or "[dim]not installed[/dim]")
    env.add_row("tritonserver", report.tritonserver or "[dim]not found[/dim]")
    if report.gpus:
        for i, g in enumerate(report.gpus):
            env.add_row(
                f"GPU {i}",
                f"{g.name}, compute capability {g.compute_capability}, "
                f"{g.memory_mib} MiB, driver {g.driver}",
            )
    else:
        env.add_row("GPU", "[dim]none found (nvidia-smi)[/dim]")
    support = Table(title="what this machine can build")
    for col in ("profile", "vision engine", "LLM engine"):
        support.add_column(col)
    for row in report.profiles:
        support.add_row(row.profile, row.vision_engine, row.llm_engine)
    return [env, support]


def serve_checks_table(repo: Path, rows: tuple[ServeCheck, ...]) -> Table:
    table = Table(title=f"serving {repo} here")
    for col in ("check", "", "detail"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.check, "[green]ok[/green]" if r.ok else "[red]no[/red]", r.detail)
    return table


def bench_tables(levels: tuple[LevelMetrics, ...]) -> list[Table]:
    """One genai-perf style table per concurrency level: per-request metrics by statistic
    (TTFT: time to first token, ITL: inter-token latency; input tokens = text + image), then
    the level's throughput and totals."""
    labels = {  # short, so the table fits 80 columns; the files carry the long names
        "request_latency": "latency (ms)",
        "time_to_first_token": "TTFT (ms)",
        "inter_token_latency": "ITL (ms)",
        "output_token_throughput_per_user": "tokens/s per user",
        "output_sequence_length": "output tokens",
        "input_sequence_length": "input tokens",
        "input_text_tokens": "input text tokens",
        "input_image_tokens": "input image tokens",
    }
    stats_shown = ("avg", "min", "max", "p50", "p90", "p99")  # std: in the files
    tables = []
    for lv in levels:
        t = Table(title=f"concurrency {lv.concurrency}: {lv.requests} requests, {lv.errors} "
                        f"errors, {lv.duration_s:.2f} s")
        t.add_column("metric", no_wrap=True)
        for stat in stats_shown:
            t.add_column(stat, justify="right")
        for name, label in labels.items():
            stats = lv.metrics[name]
            values = [f"{getattr(stats, s):.1f}" for s in stats_shown] if stats else \
                ["-"] * len(stats_shown)
            t.add_row(label, *values)
        t.caption = (f"request throughput {lv.request_throughput:.2f} requests/s, output token "
                     f"throughput {lv.output_token_throughput:.1f} tokens/s; "
                     f"{lv.total_output_tokens} output, {lv.total_input_text_tokens} text + "
                     f"{lv.total_input_image_tokens} image input tokens (input sequence length "
                     "counts both)")
        tables.append(t)
    return tables


def budget_table(reports: Sequence[BenchReport]) -> Table:
    """A budget sweep's runs side by side: per budget and concurrency, the visual tokens a
    request cost (as the deployment reports them) and the time to first token."""
    t = Table(title="image budgets: visual tokens and time to first token (ms)")
    t.add_column("budget", no_wrap=True)
    for col in ("conc", "requests", "errors", "image tok", "text tok", "TTFT avg", "TTFT p50"):
        t.add_column(col, justify="right")
    for report in reports:
        for lv in report.levels:
            ttft, done = lv.metrics["time_to_first_token"], max(lv.requests - lv.errors, 1)
            t.add_row(report.settings["budget"], str(lv.concurrency), str(lv.requests),
                      str(lv.errors), f"{lv.total_input_image_tokens / done:.0f}",
                      f"{lv.total_input_text_tokens / done:.0f}",
                      *([f"{ttft.avg:.1f}", f"{ttft.p50:.1f}"] if ttft else ["-", "-"]))
    return t


def bench_run_tables(reports: Sequence[BenchReport]) -> list[Table]:
    """Each run's tables (`bench_tables`), and with several budgets the table comparing
    them."""
    tables = [table for report in reports for table in bench_tables(report.levels)]
    return tables + [budget_table(reports)] if len(reports) > 1 else tables


@contextlib.contextmanager
def bench_progress(settings: BenchSettings) -> Iterator[Callable[[int, RequestRecord], None]]:
    """A progress bar per concurrency level of `settings` while bench runs (every budget's
    run advances it); yields the `on_done` that advances a level's bar by one request."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    runs = max(len(settings.budgets), 1)
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out, transient=False) as progress:
        tasks = {c: progress.add_task(f"concurrency {c}", total=settings.requests * runs)
                 for c in settings.concurrency}
        yield lambda c, _: progress.advance(tasks[c])


def inspect_lines(summary: dict[str, Any]) -> list[str]:
    """`Checkpoint.summary()` in three lines: the checkpoint, its LLM, its vision tower."""
    t, v = summary["text"], summary["vision"]
    return [
        f"[bold]{summary['path']}[/bold]: Qwen3-VL {summary['variant']}, "
        f"{summary['source_dtype']}, {summary['tensors']} tensors, "
        f"{summary['file_bytes'] / 2**30:.2f} GiB on disk",
        f"  LLM: {summary['parameters']['llm'] / 1e9:.3f} B parameters, hidden "
        f"{t['hidden_size']}, {t['num_layers']} layers, {t['num_heads']}/"
        f"{t['num_kv_heads']} heads x {t['head_dim']}, vocab {t['vocab_size']}, "
        f"mrope {t['mrope_section']} interleaved={t['mrope_interleaved']}, "
        f"tied embeddings={t['tie_word_embeddings']}",
        f"  vision: {summary['parameters']['vision'] / 1e9:.3f} B parameters, depth "
        f"{v['depth']}, hidden {v['hidden_size']}, out {v['out_hidden_size']}, "
        f"DeepStack after blocks {v['deepstack_visual_indexes']}",
    ]


def build_line(result: BuildResult, seconds: float) -> str:
    """The build's closing summary: what was built and skipped, and where."""
    built = [r.stage.value for r in result.stages if r.status == "built"]
    skipped = [r.stage.value for r in result.stages if r.status == "skipped"]
    return (f"build done in {seconds:.1f} s: built {', '.join(built) or 'nothing'}; skipped "
            f"{', '.join(skipped) or 'nothing'} -> {result.out}")


def infer_json(answer: Measurement) -> dict[str, Any]:
    r = answer.record
    return {"text": answer.text, "time_to_first_token_ms": time_to_first_token(r) * 1e3,
            "request_latency_ms": request_latency(r) * 1e3,
            "output_tokens_per_s": output_token_throughput_per_user(r),
            "output_tokens": r.output_tokens, "finish_reason": answer.finish_reason,
            "input_text_tokens": r.input_text_tokens, "input_image_tokens": r.input_image_tokens}


def infer_line(answer: Measurement) -> str:
    """infer's closing line (markup): TTFT, tokens/s, latency and the token counts."""
    r = answer.record
    per_user = output_token_throughput_per_user(r)
    rate = f"{per_user:.1f} tokens/s" if per_user else "tokens/s n/a (needs --stream, > 1 token)"
    return (f"[dim]TTFT {time_to_first_token(r) * 1e3:.1f} ms, {rate}, latency "
            f"{request_latency(r):.2f} s; {r.output_tokens} output tokens"
            f"{f' ({answer.finish_reason})' if answer.finish_reason else ''}, prompt "
            f"{r.input_text_tokens + r.input_image_tokens} tokens ({r.input_text_tokens} text + "
            f"{r.input_image_tokens} image)[/dim]")


def print_answer(answer: Measurement, *, json_out: bool, streamed: bool) -> None:
    """infer's output: the answer (already printed piece by piece when streamed), then its
    closing line; or both as one JSON object."""
    if json_out:
        print_json(infer_json(answer))
        return
    print_text(answer.text if not streamed else "")
    out.print(infer_line(answer))


def verify_line(r: CaseResult) -> str:
    """One case (markup): ok or FAIL, and where the token ids first differ."""
    mark = "[green]ok[/green]" if r.passed else "[red]FAIL[/red]"
    if r.first_divergence is None:
        detail = f"{len(r.candidate)} tokens identical"
    else:
        i = r.first_divergence
        ref = r.reference[i] if i < len(r.reference) else "end"
        cand = r.candidate[i] if i < len(r.candidate) else "end"
        detail = (f"first divergence at token {i}: reference {ref}, deployment {cand} "
                  f"({r.must_match} must match)")
    return f"{mark} {r.name}: {detail}"


def agreement_lines(result) -> list[str]:
    """Each case of a checkpoint comparison (qvl_trt.llm.agreement.Agreement), then the
    summary."""
    lines = []
    for c in result.cases:
        where = ("identical" if c.first_divergence is None
                 else f"first divergence at token {c.first_divergence}")
        lines.append(f"{c.name}: {len(c.baseline)} tokens, {where}, max logit difference "
                     f"{c.max_logit_diff:.3g}")
    return [*lines, result.summary()]


def verify_json(results: list[CaseResult]) -> list[dict[str, Any]]:
    return [{**{k: getattr(r, k) for k in ("name", "first_divergence", "must_match",
                                           "reference", "candidate")},
             "passed": r.passed} for r in results]


def validate_lines(report: ValidationReport) -> list[str]:
    """Each problem, then the verdict (markup)."""
    verdict = "[green]valid[/green]" if report.ok else \
        f"[red]{len(report.problems)} problem(s)[/red]"
    return [*(f"[red]problem[/red] {problem}" for problem in report.problems),
            f"{report.repo}: {len(report.models)} models, {report.checks} checks, {verdict}"]


def validate_json(report: ValidationReport) -> dict[str, Any]:
    return {"repo": str(report.repo), "ok": report.ok, "checks": report.checks,
            "models": report.models, "problems": [str(p) for p in report.problems]}


def serving_lines(server: TritonServer, gateway: GatewayProcess | None, *,
                  health_port: int | None) -> str:
    """What `qvl-trt serve` prints once it serves."""
    from ..serve.server import local_address

    health = "" if health_port is None else \
        f", readiness http://{local_address(server.opts.host, health_port)}/ready"
    lines = [f"tritonserver ({server.install.origin}) ready: HTTP {server.http_url}, gRPC "
             f"{server.grpc_url}, metrics {server.metrics_url}{health}; Ctrl-C stops it"]
    if gateway is not None:
        lines.append(f"OpenAI endpoint {gateway.url}/v1, chat page {gateway.url}/")
    return "\n".join(lines)


def image_lines(recipe: ImageRecipe, repo: Path | None) -> list[str]:
    """What `qvl-trt image` prints: what the recipe adds, how to build the image and, given a
    repository, how to serve it."""
    from ..deploy.container import (
        TRTLLM_CONTAINER,
        baked_container_command,
        serve_container_command,
    )

    lines = [f"wrote the image recipe {recipe.context}: adds {', '.join(recipe.requirements)}",
             f"build it with: {recipe.build_command}"]
    if recipe.baked_root is not None:
        lines += [f"the image carries {repo} at {recipe.baked_root}: its size is the base "
                  f"image's ({TRTLLM_CONTAINER}), the additions' and "
                  f"{recipe.repo_bytes / 2**30:.2f} GiB of repository "
                  f"({recipe.repo_bytes:,} bytes)",
                  f"serve it with: {baked_container_command(recipe.needs, recipe.tag)}"]
    elif recipe.needs is not None:
        lines.append(f"serve {repo} with: {serve_container_command(recipe.needs, recipe.tag)}")
    return lines


def deploy_lines(result: DeployResult, repo: Path) -> list[str]:
    """What `qvl-trt deploy` prints: the files, each pod's needs, where the pods find the
    repository, who may reach what, and the `kubectl apply` line."""
    opts, needs = result.opts, result.needs
    lines = [f"wrote {', '.join(result.files)} into {result.out}",
             *(f"  {note}" for note in needs.notes)]
    if opts.repo_in_image:
        lines.append(f"the pods serve the repository in {opts.image} at {needs.mount_path} "
                     f"(built with `qvl-trt image --repo {repo} --bake-repo`)")
    else:
        where = f"the claim {result.claim}" if result.claim else \
            f"the node folder {opts.host_path}"
        inside = f" under {opts.claim_path}" if opts.claim_path else ""
        lines.append(f"the pods mount {where} at {needs.mount_path} (it must hold the "
                     f"repository{inside})")
    return [*lines, *result.access, f"apply them with: {result.apply_command}"]


def key_added_line(entry: KeyEntry, keys_file: Path) -> str:
    """`keys add`'s line before the key itself."""
    return (f"added key {entry.id} for tenant {entry.tenant} to {keys_file}; the key, shown "
            "this once:")


def key_removed_line(entry: KeyEntry, keys_file: Path) -> str:
    return f"removed key {entry.id} of tenant {entry.tenant} from {keys_file}"


def keys_lines(ring: KeyRing) -> list[str]:
    """`keys list`: a line per key, with its tenant's scope and quotas."""
    lines = []
    for entry in ring.keys:
        tenant = ring.tenants[entry.tenant]
        quotas = ", ".join(f"{k} {v}" for k, v in vars(tenant.quotas).items() if v is not None)
        lines.append(f"{entry.id}  {entry.tenant}  created {entry.created or '-'}  "
                     f"scope {tenant.cache_scope!r}  {quotas or 'no quotas'}")
    return lines


def gateway_line(opts: GatewayOptions) -> str:
    """What `qvl-trt gateway` prints once it listens."""
    from ..serve.server import local_address

    shown = f"http://{local_address(opts.host, opts.port)}"
    return (f"gateway listening: OpenAI endpoint {shown}/v1, chat page {shown}/ (Triton gRPC "
            f"{opts.triton_url}); Ctrl-C stops it")
