"""A picture of the Grafana dashboard that `qvl-trt deploy --monitoring` writes, drawn from real
metrics of a load run: no Grafana installs here, so this renders the same queries the way
Grafana would, from a real Prometheus.

It serves the tiny checkpoint's reference repository with `qvl-trt serve --openai-port`
(supervisor, gateway, health port), starts Debian's prometheus (make prometheus)
on 127.0.0.1 scraping the pod's three metrics pages every --scrape-interval seconds with the
labels the PodMonitor's targets get (namespace, pod, container, endpoint, job NAMESPACE/NAME),
and loads the deployment as an operator's clients would: more concurrent streams than batch
slots, long answers (ignore_eos), images sent as encoded bytes (some repeated, so the vision
cache hits), short questions, a few questions asked again and again (so the answer cache
hits), clients that go away mid-answer (499) and requests that fail
with 400. Then, for every target of every panel of the dashboard's JSON (deploy/monitoring.py),
it runs `query_range` with the dashboard's variables and `$__rate_interval` substituted as
Grafana does, prints each query with the number of series it returned, and draws the panels
in the dashboard's grid (gridPos): title, legend from legendFormat, unit. The DCGM exporter's
panels (GPU utilisation and memory) say that their data comes from outside the pod. Every
process it started is stopped on exit, Ctrl-C and errors included.

The figures are the reference flavor's, decoding on this machine's CPU: the picture shows what
the dashboard shows, not what a GPU delivers.

Usage: python scripts/render_dashboard.py [--out docs/images/dashboard.png] [--seconds 150]
       [--streams 12] [--scrape-interval 2] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import datetime as dt
import io
import itertools
import json
import math
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from bench_preprocess import photo_like
from bench_saturation import Served, batch_slots
from PIL import Image

from qvl_trt.child import kill_group, popen_owned, signals_held
from qvl_trt.deploy import monitoring as m
from qvl_trt.deploy.kubernetes import CONTAINER, DEFAULT_NAME
from qvl_trt.deps import require
from qvl_trt.serve.server import free_ports
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo
from qvl_trt.triton import contract as c

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "inference"
# A Deployment's pods are named NAME-<replica set hash>-<pod hash>; the dashboard's GPU queries
# match NAME-.+.
POD = f"{DEFAULT_NAME}-5d9c8b7f64-x7k2q"
# Grafana's grid: 24 columns; a row unit is 30 px plus an 8 px margin
# (grafana/grafana public/app/core/constants.ts GRID_CELL_HEIGHT, GRID_CELL_VMARGIN).
GRID_COLUMNS, ROW_PX, WIDTH_PX, DPI = 24, 38, 1600, 100
LEGEND_COLUMNS = 4
# Grafana's dark theme and its classic palette.
BACKGROUND, PANEL, TEXT, DIM = "#111217", "#181b1f", "#ccccdc", "#8e8e9e"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#705da0", "#37872d", "#fade2a")
IMAGE_SIZES = ((320, 240), (640, 480), (480, 640), (800, 600))
LOAD_KINDS = ("long", "image", "short", "faq", "long", "image", "disconnect", "image", "long",
              "faq", "short", "bad_image", "image", "long", "faq", "too_long")
# Questions asked again and again, greedy, each with a stop string taken from its own answer
# (`faq_stops`) so that the answer ends by itself and the answer cache keeps it.
FAQ = ("What are your opening hours?", "How do I reset my password?", "Where is my order?")
FAQ_TOKENS = 24


# ---- Prometheus ------------------------------------------------------------------------------

def scrape_config(local_ports: dict[str, int], scrape_s: float) -> dict:
    """Prometheus' configuration: one job per endpoint of the PodMonitor (its port names and
    paths, read from the manifest deploy/monitoring.py writes), relabelled as the Prometheus
    Operator relabels a PodMonitor's pod targets (prometheus-operator
    pkg/prometheus/promcfg.go, generatePodMonitorConfig: namespace, container and pod from the
    pod's metadata, job NAMESPACE/NAME, endpoint the port's name)."""
    meta = {"name": DEFAULT_NAME, "namespace": NAMESPACE, "labels": {}}
    monitor = m.manifests(DEFAULT_NAME, meta, {})["podmonitor.yaml"]
    labels = {"namespace": NAMESPACE, "container": CONTAINER, "pod": POD,
              "job": m.job(DEFAULT_NAME, NAMESPACE)}
    jobs = []
    for index, endpoint in enumerate(monitor["spec"]["podMetricsEndpoints"]):
        port = endpoint["port"]
        jobs.append({
            "job_name": f"podMonitor/{NAMESPACE}/{DEFAULT_NAME}/{index}",
            "scrape_interval": f"{scrape_s:g}s", "scrape_timeout": f"{scrape_s:g}s",
            "metrics_path": endpoint.get("path", "/metrics"),
            "static_configs": [{"targets": [f"127.0.0.1:{local_ports[port]}"]}],
            "relabel_configs": [{"target_label": k, "replacement": v}
                                for k, v in {**labels, "endpoint": port}.items()]})
    return {"global": {"scrape_interval": f"{scrape_s:g}s"}, "scrape_configs": jobs}


class Prometheus:
    """Prometheus (`binary`) on a free port of 127.0.0.1, its data under `root`; it never
    outlives this script (popen_owned)."""

    def __init__(self, binary: str, root: Path, config: dict) -> None:
        (root / "prometheus.yml").write_text(json.dumps(config, indent=1))  # YAML 1.2
        self.url = f"http://127.0.0.1:{free_ports().http}"
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        with signals_held():
            self.process = popen_owned(
                [binary, f"--config.file={root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"prometheus did not get ready; see {self.log.name}") from None
                time.sleep(0.5)

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=60) as reply:
                return json.load(reply)["data"]
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"prometheus refused {params}: {exc.read().decode()}") from None

    def targets_up(self) -> int:
        return sum(t["health"] == "up" for t in self.api("targets")["activeTargets"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step:g}")["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.process.pid)
            self.process.wait()
        self.log.close()


# ---- the load --------------------------------------------------------------------------------

def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def faq_stops(api) -> dict[str, str]:
    """Each FAQ question's stop string: a piece of its greedy streamed answer that first
    appears where it stands, so the answer ends there by itself (the tiny random model seldom
    ends one on its own, and an answer cut at max_tokens is never kept by the answer cache).
    Whole pieces: stop strings match the tokens' text, not any substring of it."""
    stops = {}
    for question in FAQ:
        reply = await api.chat.completions.create(
            model=c.ENSEMBLE, messages=[{"role": "user", "content": question}],
            max_tokens=FAQ_TOKENS, temperature=0, stream=True,
            extra_body={"answer_cache": False})
        pieces = [chunk.choices[0].delta.content or "" async for chunk in reply
                  if chunk.choices]
        text = "".join(pieces)
        stops[question] = next(
            (p for i, p in enumerate(pieces) if i and p.strip()
             and text.find(p) == len("".join(pieces[:i]))), pieces[0] if pieces else "?")
    return stops


async def ask(api, kind: str, n: int, picture: str, long_tokens: int,
              stops: dict[str, str]) -> str:
    """One request of `kind` (`picture`: the data URI an image question sends; `stops`: the
    FAQ questions' stop strings); its outcome: the HTTP status, or 499 for one this client
    left."""
    import openai

    content: str | list = f"Count to {n}."
    extra: dict = {}
    max_tokens, stream = 16, True
    if kind == "faq":
        content, max_tokens = FAQ[n % len(FAQ)], FAQ_TOKENS
        extra = {"stop": stops[content]}
    if kind in ("long", "disconnect"):
        max_tokens, extra = long_tokens, {"ignore_eos": True}
    elif kind in ("image", "bad_image"):
        # bad_image: a JPEG's first 300 bytes, which the server's decoder refuses.
        url = picture if kind == "image" else picture[:len("data:image/jpeg;base64,") + 400]
        content, max_tokens = [{"type": "image_url", "image_url": {"url": url}},
                               {"type": "text", "text": "Describe the picture."}], 48
    elif kind == "short":
        stream = False
    elif kind == "too_long":
        max_tokens = 1 << 20  # above the build's max_seq_len
    try:
        reply = await api.chat.completions.create(
            model=c.ENSEMBLE, messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens, temperature=0, stream=stream, extra_body=extra)
        if not stream:
            return "200"
        pieces = 0
        async for chunk in reply:
            pieces += bool(chunk.choices and chunk.choices[0].delta.content)
            if kind == "disconnect" and pieces == 8:
                await reply.close()  # the client goes away mid-answer
                return "499 (left)"
        return "200"
    except openai.APIStatusError as exc:
        return str(exc.status_code)
    except openai.OpenAIError as exc:
        return type(exc).__name__


async def load(url: str, streams: int, seconds: float, long_tokens: int) -> collections.Counter:
    """`streams` clients, started over the first fifth of `seconds`, each asking one request
    after another (cycling through LOAD_KINDS from its own offset) until `seconds` have
    passed; the outcomes by (kind, status)."""
    import openai

    images = [data_uri(photo_like(w, h, "jpeg"), "image/jpeg") for w, h in IMAGE_SIZES]
    pictures = itertools.count()
    outcomes: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + seconds
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                             timeout=3600)
    stops = await faq_stops(api)

    async def client(index: int) -> None:
        await asyncio.sleep(index * seconds / 5 / streams)
        n = index
        while time.monotonic() < stop_at:
            kind, picture = LOAD_KINDS[n % len(LOAD_KINDS)], ""
            if kind in ("image", "bad_image"):
                # Every other picture is one of a few sent again and again, every other one new
                # (a size of its own), so the vision cache both hits and misses.
                k = next(pictures)
                picture = images[k // 2 % len(images)] if k % 2 else data_uri(
                    photo_like(256 + k, 192, "jpeg"), "image/jpeg")
            outcomes[kind, await ask(api, kind, n, picture, long_tokens, stops)] += 1
            n += 1

    try:
        await asyncio.gather(*(client(i) for i in range(streams)))
    finally:
        await api.close()
    return outcomes


# ---- the dashboard's queries, as Grafana sends them ------------------------------------------

def grafana_step(range_s: float, width_px: float, scrape_s: float) -> float:
    """Grafana's $__interval (the query's step): the range over the panel's width in pixels
    (its max data points), at least the data source's scrape interval. Grafana rounds the
    quotient to a round duration, which matters only above the scrape interval."""
    return max(range_s / width_px, scrape_s)


def rate_interval(step_s: float, scrape_s: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)
    (grafana/grafana pull 77234, Prometheus: Fix $__rate_interval calculation)."""
    return f"{max(step_s + scrape_s, 4 * scrape_s):g}s"


def external(panel: dict) -> bool:
    """Whether every series the panel queries comes from outside the pod (DCGM's)."""
    return all(m.SOURCES[metric] is m.Source.DCGM for target in panel["targets"]
               for metric, _ in m.selectors(target["expr"]))


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda g: labels.get(g[1], ""), fmt)


def run_queries(prometheus: Prometheus, dashboard: dict, start: float, end: float,
                scrape_s: float) -> dict[tuple[int, str], list[dict]]:
    """(panel id, refId) -> the series of that target, each {"legend", "t", "v"}; prints each
    query as sent with its number of series."""
    results = {}
    for panel in dashboard["panels"]:
        width = panel["gridPos"]["w"] / GRID_COLUMNS * WIDTH_PX
        step = grafana_step(end - start, width, scrape_s)
        for target in panel["targets"]:
            expr = m.grafana_expanded(target["expr"], NAMESPACE, rate_interval(step, scrape_s))
            # Grafana aligns the range to the step, so a refresh draws the same points.
            series = prometheus.query_range(expr, math.floor(start / step) * step,
                                            math.floor(end / step) * step, step)
            print(f"{len(series):>3} series  {panel['title']} / {target['refId']}: {expr}")
            results[panel["id"], target["refId"]] = [
                {"legend": legend(target["legendFormat"], s["metric"]),
                 "t": [dt.datetime.fromtimestamp(float(t), dt.timezone.utc)
                       for t, _ in s["values"]],
                 "v": [float(v) for _, v in s["values"]]} for s in series]
    return results


# ---- drawing ---------------------------------------------------------------------------------

def _si(value: float, suffix: str = "") -> str:
    for scale, prefix in ((1e9, " B"), (1e6, " Mil"), (1e3, " K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{prefix}{suffix}"
    return f"{value:.3g}{suffix}"


def _seconds(value: float) -> str:
    if value == 0:
        return "0 s"
    for scale, name in ((60, "min"), (1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {name}"
    return f"{value * 1e9:.3g} ns"


def _bytes(value: float) -> str:
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(value) >= 1024 ** power:
            return f"{value / 1024 ** power:.3g} {name}"
    return f"{value:.3g} B"


# Grafana's unit ids (the panel's fieldConfig.defaults.unit) -> how an axis tick reads.
UNITS = {
    "reqps": lambda v: _si(v, " req/s"), "short": _si, "s": _seconds, "bytes": _bytes,
    "percentunit": lambda v: f"{v * 100:.3g}%", "percent": lambda v: f"{v:.3g}%",
}


def draw(dashboard: dict, results: dict, start: float, end: float, path: Path,
         caption: str) -> None:
    """The panels in their grid positions over the dashboard's time range, in Grafana's dark
    theme, as a PNG at `path` (in a palette of 128 colours: a third of the bytes)."""
    mpl = require("matplotlib", extra="serve", why="draw the dashboard")
    mpl.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    header_px, footer_px = 56, 30
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    height_px = header_px + rows * ROW_PX + footer_px
    fig = plt.figure(figsize=(WIDTH_PX / DPI, height_px / DPI), dpi=DPI, facecolor=BACKGROUND)
    unit_x = 1 / GRID_COLUMNS
    unit_y = ROW_PX / height_px
    top = 1 - header_px / height_px
    fig.text(8 / WIDTH_PX, 1 - 22 / height_px, dashboard["title"], color=TEXT, fontsize=15,
             va="center", weight="bold")
    fig.text(8 / WIDTH_PX, 1 - 44 / height_px,
             f"Data source: Prometheus    Namespace: {NAMESPACE}", color=DIM, fontsize=10,
             va="center")
    fig.text(8 / WIDTH_PX, footer_px / 2 / height_px, caption, color=DIM, fontsize=9,
             va="center")
    margin_x, margin_y = 4 / WIDTH_PX, 4 / height_px
    # Time ticks on round times, at most 8 a panel.
    span = next((s for s in (10, 15, 30, 60, 120, 300, 600, 1800) if (end - start) / s <= 8),
                3600)
    ticks = [dt.datetime.fromtimestamp(t, dt.timezone.utc)
             for t in range(math.ceil(start / span) * span, int(end) + 1, span)]
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        left, width = g["x"] * unit_x + margin_x, g["w"] * unit_x - 2 * margin_x
        bottom = top - (g["y"] + g["h"]) * unit_y + margin_y
        height = g["h"] * unit_y - 2 * margin_y
        fig.patches.append(FancyBboxPatch(
            (left, bottom), width, height, boxstyle="round,pad=0,rounding_size=0.002",
            transform=fig.transFigure, facecolor=PANEL, edgecolor="#2c3235", linewidth=0.8,
            zorder=-1))  # below the axes drawn on it
        fig.text(left + 8 / WIDTH_PX, bottom + height - 14 / height_px, panel["title"],
                 color=TEXT, fontsize=10.5, va="center", weight="bold")
        series = [s for t in panel["targets"] for s in results[panel["id"], t["refId"]]]
        # Room for the title above, the time axis and the legend below, the ticks on the left.
        # As many legend columns as the longest name leaves room for (8 pt: ~6 px a letter).
        columns = max(1, min(LEGEND_COLUMNS, int(width * WIDTH_PX // (
            6 * max((len(s["legend"]) for s in series), default=1) + 40))))
        legend_rows = math.ceil(len(series) / columns)
        ax_bottom = bottom + (26 + 16 * max(legend_rows, 1)) / height_px
        ax = fig.add_axes((left + 70 / WIDTH_PX, ax_bottom, width - 82 / WIDTH_PX,
                           bottom + height - 30 / height_px - ax_bottom), facecolor=PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.tick_params(colors=DIM, labelsize=8, length=0)
        ax.grid(color="#2f3238", linewidth=0.6)
        if external(panel) or not series:
            note = ("no data here: DCGM exporter (outside the pod; no GPU on this machine)"
                    if external(panel) else "No data")
            ax.text(0.5, 0.5, note, color=DIM, fontsize=10, ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for index, s in enumerate(series):
            ax.plot(s["t"], s["v"], color=PALETTE[index % len(PALETTE)], linewidth=1.3,
                    label=s["legend"])
        values = [v for s in series for v in s["v"] if math.isfinite(v)]
        if values and min(values) >= 0:
            ax.set_ylim(bottom=0, top=max(max(values) * 1.08, 1e-9))
        ax.yaxis.set_major_locator(MaxNLocator(5))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, f=UNITS[
            panel["fieldConfig"]["defaults"]["unit"]]: f(v)))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=dt.timezone.utc))
        ax.set_xticks(ticks)
        ax.tick_params(axis="x", pad=8)  # below the lowest value's label
        ax.set_xlim(*(dt.datetime.fromtimestamp(t, dt.timezone.utc) for t in (start, end)))
        ax.legend(loc="upper left", bbox_to_anchor=(-0.02, -0.09), ncol=columns,
                  frameon=False, fontsize=8, labelcolor=TEXT, handlelength=1.2,
                  borderaxespad=0, columnspacing=1.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, dpi=DPI, facecolor=BACKGROUND)
    plt.close(fig)
    Image.open(png).convert("RGB").quantize(128).save(path, optimize=True)


# ---- the run ---------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=150, help="how long the load runs")
    parser.add_argument("--streams", type=int, default=12,
                        help="concurrent clients (the tiny build has 8 batch slots)")
    parser.add_argument("--long-tokens", type=int, default=400,
                        help="tokens of a long answer (ignore_eos)")
    parser.add_argument("--scrape-interval", type=float, default=2.0, help="seconds")
    parser.add_argument("--work-dir", type=Path, help="where to build, serve and keep "
                        "Prometheus' data (default: a temporary folder, removed at the end)")
    parser.add_argument("--print-config", action="store_true", help="print the Prometheus "
                        "configuration (on free ports) and exit, starting nothing")
    args = parser.parse_args()
    dashboard = m.dashboard(DEFAULT_NAME)
    units = {p["fieldConfig"]["defaults"]["unit"] for p in dashboard["panels"]} - set(UNITS)
    if units:  # said before the run, not after
        raise SystemExit(f"the dashboard uses the unit(s) {sorted(units)}, which this script "
                         "cannot draw: add them to UNITS")
    if args.print_config:
        ports = free_ports()
        print(json.dumps(scrape_config({"metrics": ports.metrics, "openai": ports.http,
                                        "health": ports.grpc}, args.scrape_interval), indent=1))
        return
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        raise SystemExit(f"--work-dir {args.work_dir} holds an earlier run: name a new or "
                         "empty folder")
    binary = shutil.which("prometheus")
    if binary is None:  # said before the build, not after
        raise SystemExit("needs prometheus: run `make prometheus` as root "
                         "(apt-get install prometheus)")
    with tempfile.TemporaryDirectory(prefix="qvl-dashboard-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        repo = build_tiny_reference_repo(root).path
        slots = batch_slots(repo)
        served = Served(repo, root / "serve.log")
        prometheus = None
        try:
            prometheus = Prometheus(binary, root, scrape_config(
                {"metrics": served.ports.metrics, "openai": served.openai,
                 "health": served.health}, args.scrape_interval))
            served.wait_ready()
            prometheus.wait_ready()
            while prometheus.targets_up() < 3:
                time.sleep(args.scrape_interval)
            time.sleep(2 * args.scrape_interval)  # every page scraped since it was ready
            start = time.time()
            time.sleep(10 * args.scrape_interval)  # an idle stretch before the load
            print(f"load: {args.streams} streams on {slots} batch slots for "
                  f"{args.seconds:g} s", flush=True)
            outcomes = asyncio.run(load(f"http://127.0.0.1:{served.openai}", args.streams,
                                        args.seconds, args.long_tokens))
            time.sleep(10 * args.scrape_interval)  # the drained state, scraped
            end = time.time()
            for (kind, status), count in sorted(outcomes.items()):
                print(f"{count:>4} x {kind}: {status}")
            results = run_queries(prometheus, dashboard, start, end, args.scrape_interval)
        finally:
            if prometheus is not None:
                prometheus.stop()
            served.stop()
    day = dt.datetime.fromtimestamp(end, dt.timezone.utc).strftime("%Y-%m-%d")
    draw(dashboard, results, start, end, args.out,
         f"Rendered by scripts/render_dashboard.py on {day} from a real "
         f"Prometheus after a {args.seconds:g} s load of {args.streams} streams on the "
         f"reference flavor (CPU, tiny checkpoint, {slots} batch slots): not GPU figures.")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
