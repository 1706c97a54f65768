"""Benchmark results as files: JSON (everything, per-request records included), CSV (one row
per concurrency and metric) and a PNG of latency against throughput across concurrency."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..atomic import staged_file, write_json_atomic
from ..deps import require
from .bench import BenchReport
from .metrics import REQUEST_METRICS, LevelMetrics

STAT_FIELDS = ("avg", "min", "max", "std", "p50", "p90", "p99")
# Per-level numbers: name -> unit.
LEVEL_FIELDS = {
    "requests": "requests",
    "errors": "requests",
    "duration_s": "s",
    "request_throughput": "requests/s",
    "output_token_throughput": "tokens/s",
    "total_output_tokens": "tokens",
    "total_input_text_tokens": "tokens",
    "total_input_image_tokens": "tokens",
}


def report_json(report: BenchReport) -> dict[str, Any]:
    levels = []
    for level in report.levels:
        entry = {name: getattr(level, name) for name in ("concurrency", *LEVEL_FIELDS)}
        entry["metrics"] = {
            name: {"unit": unit, **(asdict(level.metrics[name]) if level.metrics[name] else {})}
            for name, unit in REQUEST_METRICS.items()
        }
        entry["records"] = [asdict(r) for r in report.records[level.concurrency]]
        levels.append(entry)
    return {
        "settings": report.settings,
        "environment": report.environment,
        "input_sequence_length": "text tokens + image tokens (every prompt token the "
                                 "language model sees)",
        "levels": levels,
    }


def report_csv(report: BenchReport) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(("concurrency", "metric", "unit", "value", *STAT_FIELDS))
    for level in report.levels:
        for name, unit in LEVEL_FIELDS.items():
            writer.writerow((level.concurrency, name, unit, _num(getattr(level, name)),
                             *[""] * len(STAT_FIELDS)))
        for name, unit in REQUEST_METRICS.items():
            stats = level.metrics[name]
            values = [_num(getattr(stats, f)) for f in STAT_FIELDS] if stats else \
                [""] * len(STAT_FIELDS)
            writer.writerow((level.concurrency, name, unit, "", *values))
    return buf.getvalue()


def _num(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def write_plot(levels: tuple[LevelMetrics, ...], path: Path) -> Path:
    """Request latency (p50, p90) and TTFT (p50) against output token throughput, one point
    per concurrency level, labelled with it."""
    matplotlib = require("matplotlib", extra="serve", why="plot the benchmark")
    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    measured = [lv for lv in levels if lv.metrics["request_latency"]]
    x = [lv.output_token_throughput for lv in measured]
    for label, metric, stat, style in (
        ("request latency p50", "request_latency", "p50", "o-"),
        ("request latency p90", "request_latency", "p90", "s--"),
        ("time to first token p50", "time_to_first_token", "p50", "^:"),
    ):
        ax.plot(x, [getattr(lv.metrics[metric], stat) for lv in measured], style, label=label)
    for lv, xi in zip(measured, x, strict=True):
        ax.annotate(f"c={lv.concurrency}", (xi, lv.metrics["request_latency"].p50),
                    textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("output token throughput (tokens/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency vs throughput across concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with staged_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


def write_budget_reports(reports: Sequence[BenchReport], out_dir: Path) -> list[Path]:
    """`write_reports` of one run in `out_dir`, of a budget sweep's runs each in a folder of
    `out_dir` named after its budget (':' as '_')."""
    if len(reports) == 1:
        return list(write_reports(reports[0], out_dir).values())
    return [path for report in reports for path in write_reports(
        report, out_dir / report.settings["budget"].replace(":", "_")).values()]


def write_reports(report: BenchReport, out_dir: Path) -> dict[str, Path]:
    """bench.json, bench.csv and bench.png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "csv": out_dir / "bench.csv",
             "png": out_dir / "bench.png"}
    write_json_atomic(paths["json"], report_json(report))
    with staged_file(paths["csv"], "w") as f:
        f.write(report_csv(report))
    write_plot(report.levels, paths["png"])
    return paths
