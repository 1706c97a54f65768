"""Host memory of each process of `qvl-trt serve --openai-port` on a reference repository: the
resident set (VmRSS) idle once loaded, its peak under an operator's load (the most of the
samples and of VmHWM from /proc/PID/status) and idle again after it, per model kind, with
the number of instances and a suggested allowance per instance (peak x --margin, rounded up
to 64 MiB).

By default it builds the tiny random checkpoint (the released structure; --dims overrides
its sizes) for a shipped profile (--gpu, 4090d), writes its reference repository and serves
it as an operator would (bench_saturation.py's `Served`: supervisor, gateway, readiness).
With --repo it serves that repository instead. Every process under serve is sampled every
--interval seconds: serve itself, the gateway, tritonserver and each python backend stub
(named by the instance its command line ends with). The load: 2x the batch slots in clients
(--multiple), each sending --rounds requests through the gateway with the `openai` client,
kinds in turn: text, JPEGs and PNGs of 1920x1080 and 4000x3000 sent as data URIs, two
images, a 4 s 1280x720 MP4 (PyAV), and a json_schema answer (guided: xgrammar); long
answers (ignore_eos, --max-tokens) except the guided one, which needs its end token. It
prints the inputs' sizes, then the table, split in two: the processes that are the same in
the trt flavor (serve, gateway, tritonserver without CUDA and the tensorrtllm backend,
preprocessing, postprocessing, tensorrt_llm_bls), and the reference flavor's own
tensorrt_llm and vision_encoder, torch on the CPU, which do not stand for the trt flavor's
GPU processes.

RSS counts a shared library's pages in every process that maps them (the stubs share
Python, numpy and the backend's libraries) and the /dev/shm pages a process touched (the
python backend's tensors: the shmem column), which the pod's /dev/shm volume counts already;
so a sum of RSS is above what the pod's memory cgroup charges: the allowances err on the
safe side. The anon column is the private part.

Usage: python scripts/measure_serve_memory.py [--gpu 4090d] [--dims k=v,...] [--repo REPO]
       [--multiple 2] [--rounds 2] [--max-tokens 500] [--interval 0.2] [--margin 1.5]
       [--time-limit 900] [--work-dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
ROUND_TO = 64 * MIB
# Processes that run as they do in the trt flavor, and the reference flavor's own ones.
SAME_IN_TRT = ("serve", "gateway", "tritonserver", "preprocessing", "postprocessing",
               "tensorrt_llm_bls")
REFERENCE_ONLY = ("tensorrt_llm", "vision_encoder")
IDLE_S = 6.0  # longer than the supervisor's probe interval (5 s): a probe is part of idle
ASK = "Describe this in detail."
SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string"},
    "objects": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "count": {"type": "integer"}}, "required": ["summary", "objects"]}


@dataclass
class Proc:
    kind: str
    idle: int = 0  # VmRSS, bytes, at the end of the idle window after loading
    peak: int = 0  # the most VmRSS sampled under the load
    peak_anon: int = 0  # the most RssAnon sampled under the load (not shared with others)
    # the most RssShmem sampled under the load: /dev/shm pages (the python backend's tensors),
    # which the pod's /dev/shm volume already counts
    peak_shmem: int = 0
    hwm: int = 0  # VmHWM at the last sample: the lifetime peak, start-up included
    after: int = 0  # VmRSS idle again after the load
    samples: int = 0


@dataclass(frozen=True)
class Input:
    name: str
    content: list
    note: str  # the sizes a client sent: file bytes, pixels, decoded RGB
    guided: bool = False


@dataclass
class Outcome:
    sent: int = 0
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


def status(pid: int) -> dict[str, int] | None:
    """VmRSS, VmHWM, RssAnon and RssShmem of a process in bytes; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {k: int(v.split()[0]) * 1024 for k, v in
            (line.split(":", 1) for line in text.splitlines())
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssShmem")}


def tree(root: int) -> dict[int, str]:
    """Every live process under `root`, root included: pid -> its kind."""
    from qvl_trt.serve.server import STUB_NAME

    parent, argv = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            pid = int(stat.parent.name)
            parent[pid], argv[pid] = int(fields[1]), [a.decode(errors="replace")
                                                      for a in cmdline]
    found = {}
    for pid in parent:
        up = pid
        while up in parent and up != root:
            up = parent[up]
        if up != root or not argv[pid][0]:
            continue  # not under serve, or a kernel thread
        args, exe = argv[pid], Path(argv[pid][0]).name
        if pid == root:
            found[pid] = "serve"
        elif exe == STUB_NAME and len(args) > 3:
            # python_backend src/stub_launcher.cc: ... INSTANCE_NAME RUNTIME, and the NUL
            # that ends the command line; instances are named MODEL_GROUP_INDEX
            found[pid] = re.sub(r"_\d+_\d+$", "", args[-3])
        elif exe == "tritonserver":
            found[pid] = "tritonserver"
        elif "gateway" in args and "qvl_trt.cli" in args:
            found[pid] = "gateway"
        else:
            found[pid] = f"other: {exe}"
    return found


class Sampler(threading.Thread):
    """Samples every process under serve; the process tree is read again every 2 s, so a
    restarted stub is found (its figures start anew)."""

    def __init__(self, root: int, interval_s: float) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.root, self.interval_s = root, interval_s
        self.procs: dict[int, Proc] = {}
        self.alive: dict[str, int] = {}  # the most processes of a kind seen at once
        self.phase = "idle"
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        pids: dict[int, str] = {}
        rescan = 0.0
        while not self.halt.is_set():
            if time.monotonic() >= rescan:
                pids, rescan = tree(self.root), time.monotonic() + 2.0
            with self.lock:
                counts: dict[str, int] = {}
                for pid, kind in pids.items():
                    values = status(pid)
                    if values is None:
                        continue
                    counts[kind] = counts.get(kind, 0) + 1
                    proc = self.procs.setdefault(pid, Proc(kind))
                    rss = values.get("VmRSS", 0)
                    proc.hwm, proc.samples = values.get("VmHWM", 0), proc.samples + 1
                    if self.phase == "idle":
                        proc.idle = rss
                    elif self.phase == "load":
                        proc.peak = max(proc.peak, rss)
                        proc.peak_anon = max(proc.peak_anon, values.get("RssAnon", 0))
                        proc.peak_shmem = max(proc.peak_shmem, values.get("RssShmem", 0))
                    else:
                        proc.after = rss
                for kind, count in counts.items():
                    self.alive[kind] = max(self.alive.get(kind, 0), count)
            self.halt.wait(self.interval_s)


def screenshot_png(width: int, height: int) -> bytes:
    """A large PNG that compresses as screenshots do: flat bands of colour. A photo of
    4000x3000 as PNG (bench_preprocess.photo_like: 26 MiB) is 35 MiB in base64, above the
    gateway's default body limit (the builds' max_request_bytes, 32 MiB, and some room)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 8 // width * 32, y * 8 // height * 32, (x // 64 + y // 64) % 4 * 60],
                      axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def inputs() -> list[Input]:
    """One request content per kind the load cycles through."""
    from bench_preprocess import photo_like
    from bench_video_preprocess import make_clip

    def image(data: bytes, mime: str) -> dict:
        url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        return {"type": "image_url", "image_url": {"url": url}}

    def sized(data: bytes, w: int, h: int) -> str:
        return f"{len(data) / 1024:.0f} KiB file, {w}x{h}, {w * h * 3 / MIB:.1f} MiB as RGB"

    made = []
    for w, h in ((1920, 1080), (4000, 3000)):
        jpeg = photo_like(w, h, "jpeg")
        png = photo_like(w, h, "png") if w * h < 4e6 else screenshot_png(w, h)
        made += [Input(f"jpeg_{w}x{h}", [image(jpeg, "image/jpeg"), {"type": "text", "text": ASK}],
                       sized(jpeg, w, h)),
                 Input(f"png_{w}x{h}", [image(png, "image/png"), {"type": "text", "text": ASK}],
                       sized(png, w, h))]
    pair = photo_like(1920, 1080, "jpeg")
    clip = make_clip(1280, 720, 4)
    video = {"type": "video_url", "video_url": {
        "url": f"data:video/mp4;base64,{base64.b64encode(clip).decode()}"}}
    return [Input("text", [{"type": "text", "text": "Tell a long story."}], "text only"),
            *made,
            Input("two_jpegs_1920x1080", [image(pair, "image/jpeg"), image(pair, "image/jpeg"),
                                          {"type": "text", "text": "Compare them."}],
                  f"2 x {sized(pair, 1920, 1080)}"),
            Input("video_mp4_1280x720", [video, {"type": "text", "text": ASK}],
                  f"{len(clip) / 1024:.0f} KiB H.264, 4 s of 1280x720 at 30 fps, sampled at the "
                  "checkpoint's 2 fps"),
            Input("json_schema", [{"type": "text", "text": "List the objects in a kitchen."}],
                  "text, response_format json_schema (guided)", guided=True)]


async def ask(api, item: Input, max_tokens: int, outcome: Outcome) -> None:
    import openai

    extra = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "scene", "schema": SCHEMA}}} if item.guided else {
        "extra_body": {"ignore_eos": True}}
    outcome.sent += 1
    try:
        chunks = await api.chat.completions.create(
            model="ensemble", messages=[{"role": "user", "content": item.content}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra)
        async for chunk in chunks:
            if chunk.usage:
                outcome.prompt_tokens = max(outcome.prompt_tokens, chunk.usage.prompt_tokens)
                outcome.completion_tokens += chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        outcome.errors.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")


async def load(port: int, items: list[Input], clients: int, rounds: int, max_tokens: int,
               time_limit_s: float) -> tuple[dict[str, Outcome], bool]:
    """`clients` at once, each sending `rounds` requests one after the other, the kinds in
    turn across clients and rounds. Returns the outcomes and whether all finished in time."""
    import openai

    outcomes = {item.name: Outcome() for item in items}
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0, timeout=time_limit_s)

    async def client(n: int) -> None:
        for r in range(rounds):
            item = items[(n + r * clients) % len(items)]
            await ask(api, item, max_tokens, outcomes[item.name])

    try:
        await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(clients))),
                               time_limit_s)
        return outcomes, True
    except TimeoutError:
        return outcomes, False
    finally:
        await api.close()


def allowance(peak: int, margin: float) -> int:
    return math.ceil(peak * margin / ROUND_TO) * ROUND_TO


def report(procs: list[Proc], alive: dict[str, int], margin: float) -> list[dict]:
    """Per kind: the most of each figure over its instances, the most instances alive at
    once (a restarted or short-lived process is not counted twice) and the suggested
    allowance per instance."""
    kinds: dict[str, list[Proc]] = {}
    for proc in procs:
        kinds.setdefault(proc.kind, []).append(proc)
    rows = []
    for kind, group in kinds.items():
        peak = max(max(p.peak, p.hwm) for p in group)
        rows.append({"kind": kind, "instances": alive[kind],
                     "idle": max(p.idle for p in group), "peak_sampled": max(p.peak for p in group),
                     "peak_anon": max(p.peak_anon for p in group),
                     "peak_shmem": max(p.peak_shmem for p in group),
                     "hwm": max(p.hwm for p in group), "after": max(p.after for p in group),
                     "peak": peak, "suggested": allowance(peak, margin)})
    order = {k: i for i, k in enumerate(SAME_IN_TRT + REFERENCE_ONLY)}
    return sorted(rows, key=lambda r: (order.get(r["kind"], len(order)), r["kind"]))


def print_table(rows: list[dict], margin: float) -> None:
    def mib(value: int) -> str:
        return f"{value / MIB:8.1f}"

    per_instance = f"x{margin:g} per inst"
    head = (f"{'process':<18} {'inst':>4} {'idle':>8} {'peak RSS':>8} {'anon':>8} "
            f"{'shmem':>8} {'VmHWM':>8} {'after':>8} {per_instance:>13}  (MiB)")
    sections = (("the same in the trt flavor", lambda k: k in SAME_IN_TRT),
                ("reference flavor only: torch on the CPU, NOT the trt flavor's GPU processes",
                 lambda k: k in REFERENCE_ONLY),
                ("other processes under serve", lambda k: k not in SAME_IN_TRT + REFERENCE_ONLY))
    for title, belongs in sections:
        chosen = [r for r in rows if belongs(r["kind"])]
        if not chosen:
            continue
        print(f"\n{title}\n{head}")
        for r in chosen:
            print(f"{r['kind']:<18} {r['instances']:>4} {mib(r['idle'])} {mib(r['peak_sampled'])} "
                  f"{mib(r['peak_anon'])} {mib(r['peak_shmem'])} {mib(r['hwm'])} {mib(r['after'])} "
                  f"{r['suggested'] / MIB:>13.0f}")
    print(f"\nsuggested allowance per instance: max(peak RSS, VmHWM) x {margin:g}, rounded up "
          "to 64 MiB")
    for r in (r for r in rows if r["kind"] in SAME_IN_TRT + REFERENCE_ONLY):
        basis = "VmHWM" if r["hwm"] >= r["peak_sampled"] else "peak RSS"
        note = " (tritonserver here: no CUDA, no tensorrtllm backend)" \
            if r["kind"] == "tritonserver" else \
            " (reference only: not a figure for the trt flavor)" \
            if r["kind"] in REFERENCE_ONLY else ""
        print(f"  {r['kind']}: {r['suggested'] // MIB} MiB per instance x {r['instances']} "
              f"({basis} {r['peak'] / MIB:.1f} MiB x {margin:g}){note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="4090d", help="shipped profile of the tiny build")
    parser.add_argument("--dims", default="", help="tiny checkpoint sizes, e.g. "
                        "text_hidden=1024,vision_hidden=256 (make_tiny_checkpoint.py --dims)")
    parser.add_argument("--repo", type=Path, help="serve this repository instead")
    parser.add_argument("--multiple", type=int, default=2, help="clients, in batch slots")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--margin", type=float, default=1.5, help="allowance = peak x this")
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="seconds the load may take; what is unfinished is cancelled")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    from bench_saturation import Served, batch_slots, build_repo

    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    items = inputs()
    with tempfile.TemporaryDirectory(prefix="qvl-serve-mem-") as tmp:
        root = args.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        repo = args.repo or build_repo(root, args.gpu, args.dims)
        slots = batch_slots(repo)
        clients = args.multiple * slots
        served = Served(repo, root / "serve.log")
        sampler = Sampler(served.process.pid, args.interval)
        try:
            served.wait_ready()
            sampler.start()
            time.sleep(IDLE_S)
            sampler.phase = "load"
            start = time.monotonic()
            outcomes, finished = asyncio.run(load(served.openai, items, clients, args.rounds,
                                                  args.max_tokens, args.time_limit))
            seconds = time.monotonic() - start
            sampler.phase = "after"
            time.sleep(IDLE_S)
            restarts = served.state()["restarts"]
        finally:
            sampler.halt.set()
            served.stop()
    with sampler.lock:
        rows = report(list(sampler.procs.values()), sampler.alive, args.margin)
    print(f"revision {revision}; repository {'given' if args.repo else args.gpu} "
          f"{args.dims or 'default dims'}; {slots} batch slots; {clients} clients x "
          f"{args.rounds} requests, {args.max_tokens}-token answers (ignore_eos; the guided "
          f"ones end by themselves); {seconds:.0f} s{'' if finished else ' (time limit hit)'}; "
          f"{restarts} restarts; sampled every {args.interval:g} s")
    print(f"\n{'input':<22} {'sent':>4} {'err':>3} {'prompt':>6} {'output':>7}  sizes")
    for item in items:
        o = outcomes[item.name]
        print(f"{item.name:<22} {o.sent:>4} {len(o.errors):>3} {o.prompt_tokens:>6} "
              f"{o.completion_tokens:>7}  {item.note}")
        for error in sorted(set(o.errors))[:2]:
            print(f"    {error}")
    print_table(rows, args.margin)
    if args.json:
        args.json.write_text(json.dumps({
            "revision": revision, "slots": slots, "clients": clients, "rounds": args.rounds,
            "max_tokens": args.max_tokens, "seconds": seconds, "restarts": restarts,
            "inputs": {i.name: {"note": i.note, **vars(outcomes[i.name])} for i in items},
            "kinds": rows}, indent=2))


if __name__ == "__main__":
    main()
