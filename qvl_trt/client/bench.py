"""`qvl-trt bench`: a bounded closed-loop load generator over a deployment.

At each concurrency C, C workers (threads, one connection each) send the level's N requests
one after another until all N are answered; each request's send time and response arrival
times become a `RequestRecord`, aggregated by `metrics.level_metrics`. The metric
definitions are genai-perf's (see metrics.py).
"""

from __future__ import annotations

import io
import ipaddress
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from ..chat_messages import ImageBudget, parse_image_budget
from ..deps import require
from ..errors import InputError, RequestError
from ..triton import contract as c
from .chat import ChatClient, openai_endpoint
from .generate import (
    Endpoint,
    GenerateClient,
    GenerateRequest,
    Generation,
    Response,
    parse_url,
)
from .metrics import LevelMetrics, RequestRecord, level_metrics

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")


class BenchEndpoint(str, Enum):
    """What bench sends its requests to: the same question, measured alike, on each path."""

    ENSEMBLE = "ensemble"  # the build's ensemble, over gRPC or HTTP generate_stream
    BLS = "bls"  # the build's tensorrt_llm_bls model (the gateway's upstream), the same request
    OPENAI = "openai"  # POST /v1/chat/completions through the gateway, streamed

    @classmethod
    def parse(cls, text: str) -> BenchEndpoint:
        try:
            return cls(text)
        except ValueError:
            raise InputError(f"--endpoint {text!r}: expected one of "
                             f"{', '.join(e.value for e in cls)}") from None


# A connection that streams a request's responses (GenerateClient or ChatClient).
Client = GenerateClient | ChatClient


@dataclass(frozen=True)
class BenchSettings:
    url: str
    concurrency: tuple[int, ...]
    requests: int  # per concurrency level
    max_tokens: int
    prompt: str = "Describe this image."
    images_per_request: int = 1
    warmup: int = 1  # requests sent (and not measured) before the first level
    model: str = "ensemble"  # the build's ensemble name (a named build's name)
    allow_remote: bool = False  # load a server that is not on this machine
    videos_per_request: int = 1  # with a video source
    endpoint: BenchEndpoint = BenchEndpoint.ENSEMBLE
    api_key: str | None = None  # the gateway's, for the openai endpoint
    fixed_length: bool = False  # every request exactly max_tokens tokens
    # Image budgets measured one after another (each a whole run); (): the deployment's own.
    budgets: tuple[ImageBudget, ...] = ()

    def __post_init__(self) -> None:
        # The command line's text ("1,4,16", "bls", "low,high") becomes the levels, the
        # endpoint and the budgets.
        if isinstance(self.concurrency, str):
            object.__setattr__(self, "concurrency", parse_concurrency(self.concurrency))
        object.__setattr__(self, "endpoint", BenchEndpoint.parse(self.endpoint))
        if isinstance(self.budgets, str):
            object.__setattr__(self, "budgets", parse_budgets(self.budgets))

    def target(self) -> str:
        """The Triton model a request goes to (the ensemble or the build's BLS model)."""
        if self.endpoint is BenchEndpoint.BLS:
            name = None if self.model == c.ENSEMBLE else self.model
            return c.ModelNames.for_build(name).tensorrt_llm_bls
        return self.model


@dataclass(frozen=True)
class BenchReport:
    settings: dict[str, Any]  # BenchSettings plus where the images came from
    environment: dict[str, Any]  # versions, git SHA, GPUs of the machine that measured
    levels: tuple[LevelMetrics, ...]
    records: dict[int, list[RequestRecord]]  # concurrency -> its requests, in send order


def parse_budgets(text: str | None) -> tuple[ImageBudget, ...]:
    """`--budgets low,high,max_pixels=262144` (chat_messages.parse_image_budget each);
    None or "": none."""
    return tuple(parse_image_budget(item.strip()) for item in (text or "").split(",")
                 if item.strip())


def parse_concurrency(text: str) -> tuple[int, ...]:
    """`1,4,16` -> (1, 4, 16)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InputError(f"--concurrency {text!r}: expected integers such as 1,4,16") from None
    if not levels or min(levels) < 1:
        raise InputError(f"--concurrency {text!r}: give one or more levels >= 1")
    return levels


def require_loopback(endpoint: Endpoint) -> None:
    """Refuse to load a server that is not on this machine: a load generator pointed at a
    shared deployment by mistake degrades it for everyone."""
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise InputError(f"cannot resolve {endpoint.host} ({exc}); check --url") from None
    if not all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        raise InputError(f"{endpoint.host} is not a loopback address; bench loads only this "
                         "machine's server unless you pass --allow-remote")


# Image number -> encoded image; numbers count up over the whole run.
ImageSource = Callable[[int], bytes]


def synthetic_images(width: int, height: int, seed: int | None = None) -> ImageSource:
    """Random-noise JPEGs of one size, a different one per number (so the vision cache cannot
    hide the encoder's cost), made when a request needs it rather than held in memory.
    Without a `seed` every run draws its own, so a second run against the same server does
    not hit the images the first one left in its vision cache; a seed repeats a run's images."""
    from PIL import Image

    if width < 1 or height < 1:
        raise InputError(f"--synthetic {width}x{height}: both sides must be positive")
    run = secrets.randbits(64) if seed is None else seed

    def image(n: int) -> bytes:
        pixels = np.random.default_rng([run, n]).integers(0, 256, (height, width, 3),
                                                          dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return buf.getvalue()

    return image


def image_source(folder: Path | None, synthetic: str | None,
                 seed: int | None = None) -> tuple[ImageSource | None, str]:
    """The images of `--images DIR` or `--synthetic WxH` (None: text-only requests), and
    how the report names them; `seed` repeats the synthetic images of an earlier run."""
    if folder and synthetic:
        raise InputError("pass --images DIR or --synthetic WxH, not both")
    if folder:
        return folder_images(folder), str(folder)
    if synthetic:
        return synthetic_images(*parse_size(synthetic), seed), f"synthetic {synthetic}"
    return None, "none (text only)"


def parse_size(text: str) -> tuple[int, int]:
    """`640x480` -> (640, 480)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise InputError(f"--synthetic {text!r}: expected WIDTHxHEIGHT such as 640x480") \
            from None
    return width, height


# The rate of synthetic clips: the server samples a file at 2 fps by default (the checkpoint's
# fps), so a clip of FRAMES frames at this rate reaches the model with every frame.
SYNTHETIC_VIDEO_FPS = 2


def synthetic_videos(spec: str, seed: int | None = None) -> tuple[ImageSource, str]:
    """`--synthetic-video WIDTHxHEIGHTxFRAMES`: MP4 (H.264) clips of moving colour ramps at
    SYNTHETIC_VIDEO_FPS, a different one per number (the vision cache cannot answer them), and
    the report's name for them. Made with PyAV when a request needs one."""
    try:
        width, height, frames = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise InputError(f"--synthetic-video {spec!r}: expected WIDTHxHEIGHTxFRAMES such as "
                         "1280x720x30") from None
    if min(width, height) < 16 or frames < 2 or width % 2 or height % 2:
        raise InputError(f"--synthetic-video {spec}: sides must be even and >= 16, frames >= 2")
    av = require("av", extra="serve", why="make synthetic videos")
    run = secrets.randbits(64) if seed is None else seed

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)

    def clip(n: int) -> bytes:
        slopes = np.random.default_rng([run, n]).uniform(0.05, 0.3, (2, 3)).astype(np.float32)
        ramps = (x[..., None] * slopes[0] + y[..., None] * slopes[1]).astype(np.uint8)
        buffer = io.BytesIO()
        with av.open(buffer, mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=SYNTHETIC_VIDEO_FPS,
                                    options={"preset": "ultrafast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(frames):  # uint8 sums wrap: the ramps move and cycle
                moved = ramps + np.uint8(9 * i % 256)
                out.mux(stream.encode(av.VideoFrame.from_ndarray(moved, format="rgb24")))
            out.mux(stream.encode())
        return buffer.getvalue()

    return clip, f"synthetic video {width}x{height}, {frames} frames at {SYNTHETIC_VIDEO_FPS} fps"


def folder_images(folder: Path) -> ImageSource:
    """The images in `folder` (sorted by name, read once), taken in turn."""
    if not folder.is_dir():
        raise InputError(f"--images {folder}: not a folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(f"--images {folder}: no {', '.join(IMAGE_SUFFIXES)} files in it")
    images = [p.read_bytes() for p in files]
    return lambda n: images[n % len(images)]


def request_maker(settings: BenchSettings, images: ImageSource | None,
                  first: int = 0, videos: ImageSource | None = None,
                  budget: ImageBudget | None = None) -> Callable[[int], GenerateRequest]:
    """Request i of a level whose first request is number `first` of the run; `budget`: its
    images' (None: the deployment's default)."""
    per = settings.images_per_request if images else 0
    per_video = settings.videos_per_request if videos else 0
    base = GenerateRequest(settings.prompt, max_tokens=settings.max_tokens, stream=True,
                           fixed_length=settings.fixed_length, image_budget=budget)

    def make(i: int) -> GenerateRequest:
        n, v = (first + i) * per, (first + i) * per_video
        return replace(base, images=tuple(images(n + k) for k in range(per)),
                       videos=tuple(videos(v + k) for k in range(per_video)))

    return make


def run_level(
    connect: Callable[[], Client],
    make_request: Callable[[int], GenerateRequest],
    count: int,
    concurrency: int,
    *,
    image_tokens: Callable[[GenerateRequest], int],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send `count` requests with `concurrency` in flight, each worker over its own
    `connect()`; one record per request, in order. A request is built before its send time
    is taken."""
    records: list[RequestRecord | None] = [None] * count
    next_index = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        with connect() as client:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                req = make_request(i)
                records[i] = record = measure(client, req, image_tokens(req)).record
                if on_done:
                    on_done(record)

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(min(concurrency, count))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in records if r is not None]


@dataclass(frozen=True)
class Measurement:
    """One request as its asker and the metrics see it: the answer and its timings."""

    text: str  # what arrived (before the error, for a failed request)
    record: RequestRecord
    finish_reason: str = ""  # the deployment's: "stop" or "length"; "" for a failed request

    def raise_if_failed(self) -> None:
        if self.record.error is not None:
            raise RequestError(self.record.error)


def measure(client: Client, req: GenerateRequest, image_tokens: int, *,
            on_response: Callable[[Response], None] | None = None) -> Measurement:
    """Send one request and time it, handing each response to `on_response` as it arrives;
    a failed request becomes a record with its error. Image tokens: the visual tokens the
    deployment reports (images and videos, at their budgets), else `image_tokens` (counted
    by the client); text tokens = prompt tokens - image tokens."""
    sent_at: list[float] = []
    responses: list[Response] = []
    try:
        for response in client.stream(req, sent_at=sent_at):
            responses.append(response)
            if on_response:
                on_response(response)
    except RequestError as exc:
        sent = sent_at[0] if sent_at else time.perf_counter()
        return Measurement("".join(r.text for r in responses),
                           RequestRecord(sent, None, None, error=str(exc)))
    g = Generation(sent_at[0], tuple(responses))
    if g.media_tokens is not None:
        image_tokens = sum(g.media_tokens)
    return Measurement(g.text, RequestRecord(g.sent, g.first_token, g.last_response,
                                             g.completion_tokens,
                                             g.prompt_tokens - image_tokens, image_tokens),
                       g.finish_reason)


def ask(url: str, req: GenerateRequest, *, model: str = c.ENSEMBLE,
        endpoint: BenchEndpoint | str = BenchEndpoint.ENSEMBLE, api_key: str | None = None,
        on_response: Callable[[Response], None] | None = None) -> Measurement:
    """`qvl-trt infer`: one request to the deployment at `url` (any host: one question is no
    load), through `endpoint` as bench sends each of its requests, measured alike."""
    settings = BenchSettings(url, (1,), 1, req.max_tokens, model=model, allow_remote=True,
                             endpoint=endpoint, api_key=api_key)
    if settings.endpoint is BenchEndpoint.OPENAI:
        connect, _, _ = connector(settings)  # the usage counts the visual tokens
        with connect() as client:
            return measure(client, req, 0, on_response=on_response)
    # A text-only question asks the server nothing before it is sent, so a request the
    # client refuses (text UTF-8 cannot carry) is refused with no server listening.
    with GenerateClient(url, model=settings.target()) as client:
        counted = client.image_token_counter()(req) if req.images or req.videos else 0
        return measure(client, req, counted, on_response=on_response)


def run_benchmark(
    settings: BenchSettings,
    images: ImageSource | None,
    *,
    source: str,
    on_done: Callable[[int, RequestRecord], None] | None = None,
    videos: tuple[ImageSource, str] | None = None,
    budget: ImageBudget | None = None,
) -> BenchReport:
    """Warm up, then run every concurrency level of `settings` in turn; `images` None (and no
    `videos`: a video source and its name) sends text-only requests; `budget`: the images'
    (None: the deployment's default)."""
    video_source, video_name = videos or (None, "none")
    if settings.requests < 1:
        raise InputError(f"--requests must be >= 1, got {settings.requests}")
    connect, image_tokens, target = connector(settings)
    if settings.warmup:
        warm = request_maker(settings, images, videos=video_source, budget=budget)
        run_level(connect, warm, settings.warmup, 1, image_tokens=image_tokens)
    levels, records = [], {}
    for n, concurrency in enumerate(settings.concurrency):
        first = settings.warmup + n * settings.requests
        make = request_maker(settings, images, first, videos=video_source, budget=budget)
        done = (lambda r, c=concurrency: on_done(c, r)) if on_done else None
        records[concurrency] = run_level(connect, make, settings.requests, concurrency,
                                         image_tokens=image_tokens, on_done=done)
        levels.append(level_metrics(concurrency, records[concurrency]))
    shown = {k: v for k, v in asdict(settings).items() if k not in ("api_key", "budgets")}
    return BenchReport({**shown, "endpoint": settings.endpoint.value, "target": target,
                        "images": source, "videos": video_name,
                        "budget": budget_label(budget)},
                       environment(), tuple(levels), records)


def budget_label(budget: ImageBudget | None) -> str:
    """How a run's budget is named in tables and folders (`--budgets`' spelling)."""
    return "default" if budget is None else budget.where


def run_budgets(settings: BenchSettings, images: ImageSource | None, *, source: str,
                on_done: Callable[[int, RequestRecord], None] | None = None,
                videos: tuple[ImageSource, str] | None = None) \
        -> tuple[BenchReport, ...]:
    """`run_benchmark` at each of `settings.budgets` in turn (none: once, at the deployment's
    default): one report per budget, whose image tokens are what the deployment reports."""
    return tuple(run_benchmark(settings, images, source=source, on_done=on_done,
                               videos=videos, budget=budget)
                 for budget in settings.budgets or (None,))


def connector(settings: BenchSettings) \
        -> tuple[Callable[[], Client], Callable[[GenerateRequest], int], str]:
    """A worker's connection to the endpoint of `settings`, the count of a request's image
    tokens, and what the requests go to (a Triton model or the OpenAI model id).

    Through the OpenAI endpoint the client cannot see the deployment's pixel bounds: a
    request's image tokens are those its usage reports (prompt_tokens_details; a deployment
    that does not report them: 0, its prompt tokens all counted as text), so the input
    sequence length still means the same on every path."""
    endpoint = openai_endpoint(settings.url) if settings.endpoint is BenchEndpoint.OPENAI \
        else parse_url(settings.url)
    if not settings.allow_remote:
        require_loopback(endpoint)
    if settings.endpoint is BenchEndpoint.OPENAI:
        with ChatClient(settings.url, model="", api_key=settings.api_key) as probe:
            model = probe.served_model(settings.model)
        return (lambda: ChatClient(settings.url, model=model, api_key=settings.api_key),
                lambda req: 0, model)
    with GenerateClient(settings.url, model=settings.model) as client:
        image_tokens = client.image_token_counter()
    target = settings.target()
    return lambda: GenerateClient(settings.url, model=target), image_tokens, target


def environment() -> dict[str, Any]:
    """What measured: tool versions, GPUs, the qvl-trt git commit when run from a checkout."""
    from ..manifest import tool_versions

    return {**tool_versions(), "git_sha": _git_sha(), "measured_at":
            time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _git_sha() -> str | None:
    """The commit of the qvl-trt checkout this runs from; None for an installed package
    (even one inside somebody else's git work tree)."""
    package = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]) / package.name != package:
        return None
    return lines[1]

