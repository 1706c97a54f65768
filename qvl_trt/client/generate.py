"""A client of a qvl-trt deployment: builds the ensemble's request and streams its answer,
over gRPC streaming (`grpc://host:port`, the default) or HTTP generate_stream
(`http://host:port`, server-sent events).

The ensemble is decoupled (its LLM step streams), so both transports use their streaming
endpoint even when `stream` is false; the answer then comes as one response. Each response
is stamped with `time.perf_counter()` on arrival, for TTFT and the benchmark.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import queue
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from ..chat_messages import ImageBudget, image_part
from ..deps import require
from ..errors import ConfigError, InputError, QvlError, RequestError
from ..mm.geometry import image_token_count
from ..triton import contract as c

GRPC_PORT = 8001
HTTP_PORT = 8000


@dataclass(frozen=True)
class GenerateRequest:
    """One question: a prompt, encoded images and video files, and decoding options (greedy
    by default)."""

    prompt: str
    images: tuple[bytes, ...] = ()
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = True
    videos: tuple[bytes, ...] = ()  # video files, after the images
    video_fps: float | None = None  # their sampling rate; None: the checkpoint's
    # Exactly max_tokens tokens (min_tokens = max_tokens, the end token ignored): a benchmark's
    # fixed output length, as AIPerf asks for it.
    fixed_length: bool = False
    # The structure the answer must take (guided decoding; `guide_of` makes them): a guide
    # type of llm.guided.GuideType and its guide.
    guide_type: str | None = None
    guide: str | None = None
    # Every image's budget (chat_messages.ImageBudget); None: the deployment's default, the
    # request in the text form. With a budget the request is chat messages (`user_content`).
    image_budget: ImageBudget | None = None


@dataclass(frozen=True)
class Response:
    """One response of the ensemble."""

    received: float  # time.perf_counter() on arrival
    text: str  # the new text when streaming, the whole answer otherwise
    prompt_tokens: int  # visual tokens included
    completion_tokens: int  # generated so far
    finish_reason: str = ""  # in the final response: "stop" or "length"
    # (image, video) tokens of the prompt as the deployment reports them (None: it does not)
    media_tokens: tuple[int, int] | None = None


@dataclass(frozen=True)
class Generation:
    """A finished request: when it was sent and every response."""

    sent: float
    responses: tuple[Response, ...]

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    @property
    def prompt_tokens(self) -> int:
        return max((r.prompt_tokens for r in self.responses), default=0)

    @property
    def completion_tokens(self) -> int:
        return max((r.completion_tokens for r in self.responses), default=0)

    @property
    def media_tokens(self) -> tuple[int, int] | None:
        """The prompt's (image, video) tokens, from the responses that report them."""
        return next((r.media_tokens for r in reversed(self.responses)
                     if r.media_tokens is not None), None)

    @property
    def finish_reason(self) -> str:
        """Why the answer ended ("stop" or "length"), as the deployment decided."""
        return next((r.finish_reason for r in reversed(self.responses) if r.finish_reason), "")

    @property
    def first_token(self) -> float | None:
        """Arrival of the first response that carried output: generated tokens (the
        ensemble's responses) or text (the OpenAI endpoint's content chunks, which carry no
        counts)."""
        return next((r.received for r in self.responses if r.completion_tokens > 0 or r.text),
                    None)

    @property
    def last_response(self) -> float | None:
        return self.responses[-1].received if self.responses else None


@dataclass(frozen=True)
class Endpoint:
    protocol: str  # "grpc" | "http"
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_url(url: str) -> Endpoint:
    """`grpc://host[:8001]`, `http://host[:8000]` or `host:port` (gRPC)."""
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme not in ("grpc", "http") or not parts.hostname:
        raise InputError(f"--url {url!r}: expected grpc://HOST:PORT or http://HOST:PORT")
    default = GRPC_PORT if parts.scheme == "grpc" else HTTP_PORT
    try:
        port = parts.port or default
    except ValueError:
        raise InputError(f"--url {url!r}: the port is not a number") from None
    return Endpoint(parts.scheme, parts.hostname, port)


def image_data_uri(data: bytes) -> str:
    """An encoded image as a data: URI (the form JSON transports carry); the server checks
    the bytes, the media type only labels them."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format or "octet-stream").lower()
    except Exception:  # not an image: the server refuses it with the reason
        kind = "octet-stream"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def image_tokens(data: bytes, *, min_pixels: int, max_pixels: int) -> int:
    """Merged visual tokens of one encoded image under these pixel bounds."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception:  # the server refuses it and the request is counted as an error
        return 0
    return image_token_count(height, width, min_pixels=min_pixels, max_pixels=max_pixels)


def video_file_tokens(data: bytes, fps: float | None,
                      limits: c.PreprocessingParameters) -> int:
    """Merged visual tokens one video file becomes on a deployment: its sampling and resize
    rules over the file's header, under the released checkpoints' clip budget (the client
    does not see the checkpoint's video_preprocessor_config.json) capped as the deployment
    caps it."""
    from ..mm.geometry import video_token_count
    from ..mm.video import (
        HF_DEFAULT_FPS,
        HF_DEFAULT_MAX_FRAMES,
        HF_DEFAULT_MIN_FRAMES,
        RELEASED_CLIP_PIXELS,
        VideoLimits,
        sample_indices,
    )
    from ..mm.video_decode import probe_video

    try:
        header = probe_video(data)
        frames = len(sample_indices(header.frames, header.fps, fps or HF_DEFAULT_FPS,
                                    min_frames=HF_DEFAULT_MIN_FRAMES,
                                    max_frames=min(HF_DEFAULT_MAX_FRAMES,
                                                   limits.max_video_frames)))
        budget = VideoLimits(max_video_tokens=limits.max_video_tokens).clip_pixels(
            RELEASED_CLIP_PIXELS[1])
        return video_token_count(frames, header.height, header.width,
                                 min_pixels=RELEASED_CLIP_PIXELS[0], max_pixels=budget,
                                 max_pixels_per_frame=limits.max_video_frame_pixels
                                 or limits.max_pixels)
    except QvlError:  # unreadable here too: the server refuses it, the request counts as failed
        return 0


def check_max_tokens(req: GenerateRequest) -> None:
    """What no endpoint can be asked for, refused before a request is sent."""
    if req.max_tokens <= 0:
        raise InputError(f"max tokens must be positive, got {req.max_tokens}")


def user_content(req: GenerateRequest) -> list[dict]:
    """The content of a question's one user turn: the prompt, then the images (at the
    request's budget) and videos as data: URIs."""
    budget = req.image_budget or ImageBudget()
    content = [{"type": "text", "text": req.prompt}]
    content += [image_part(image_data_uri(data), budget) for data in req.images]
    fps = {} if req.video_fps is None else {"fps": req.video_fps}
    content += [{"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(data).decode()}, **fps}
        for data in req.videos]
    return content


def ensemble_request(req: GenerateRequest) -> c.EnsembleRequest:
    """The ensemble's request for a question: the text form (text_input with the images and
    video files), or chat messages where the images have a budget."""
    check_max_tokens(req)
    if req.image_budget is not None:
        chat = json.dumps([{"role": "user", "content": user_content(req)}])
        media: dict = {"messages": chat}
    else:
        media = {"text_input": req.prompt, "image_bytes": req.images,
                 "video_bytes": req.videos,
                 "video_fps": () if req.video_fps is None else (req.video_fps,)}
    return c.EnsembleRequest(
        **media,
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed, stop=req.stop, stream=req.stream,
        guided_decoding_guide_type=req.guide_type, guided_decoding_guide=req.guide,
        **fixed_length_fields(req))


def guide_of(*, json_schema: Path | None = None, regex: str | None = None,
             grammar: Path | None = None, any_json: bool = False,
             compact: bool = False) -> dict[str, str | None]:
    """The guide fields of a request (GenerateRequest's guide_type and guide) from at most
    one of: a JSON schema file, a regular expression, an EBNF grammar file, any JSON.
    `compact`: the schema goes as a grammar of its JSON without free whitespace
    (llm.guided.compact_json_schema), which a model cannot pad until max_tokens."""
    from ..llm.guided import GuideType, compact_json_schema

    given = [(t, v) for t, v in ((GuideType.JSON_SCHEMA, json_schema), (GuideType.REGEX, regex),
                                 (GuideType.EBNF_GRAMMAR, grammar),
                                 (GuideType.JSON, any_json or None)) if v is not None]
    if len(given) > 1:
        raise InputError("give at most one of --json-schema, --regex, --grammar and --json: a "
                         "request takes one guide")
    if compact and json_schema is None:
        raise InputError("--compact applies to --json-schema; give the schema too")
    if not given:
        return {"guide_type": None, "guide": None}
    kind, value = given[0]
    if kind is GuideType.JSON:
        return {"guide_type": kind.value, "guide": None}
    if kind is GuideType.REGEX:
        return {"guide_type": kind.value, "guide": value}
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {value} ({exc}); give a UTF-8 text file") from None
    if kind is GuideType.JSON_SCHEMA:
        try:
            json.loads(text)
        except ValueError as exc:
            raise InputError(f"{value} is not JSON ({exc}); give a JSON schema file") from None
        if compact:
            return {"guide_type": GuideType.EBNF_GRAMMAR.value, "guide": compact_json_schema(text)}
    return {"guide_type": kind.value, "guide": text}


def fixed_length_fields(req: GenerateRequest) -> dict:
    """min_tokens and ignore_eos of a fixed output length (the ensemble's inputs and the chat
    API's fields share the names); none otherwise."""
    return {"min_tokens": req.max_tokens, "ignore_eos": True} if req.fixed_length else {}


def http_body(req: GenerateRequest) -> dict:
    """The generate-extension JSON of a request: the tensors' rows as JSON values, images and
    videos as data: URIs."""
    body: dict = {}
    for name, value in ensemble_request(req).to_tensors().items():
        row = value[0]
        if name == c.IMAGE_BYTES:
            body[name] = [image_data_uri(v) for v in row]
        elif name == c.VIDEO_BYTES:  # the server reads the bytes; the type only labels them
            body[name] = ["data:video/mp4;base64," + base64.b64encode(v).decode() for v in row]
        elif name == c.VIDEO_FPS:
            body[name] = row.tolist()
        elif row.dtype == object:
            texts = [v.decode() for v in row]
            body[name] = texts if name == c.STOP else texts[0]
        else:
            body[name] = row[0].item()
    return body


class GenerateClient:
    """One connection to a deployment; one request at a time (one client per thread)."""

    def __init__(self, url: str, *, model: str = c.ENSEMBLE, timeout_s: float = 600.0) -> None:
        self.endpoint = parse_url(url)
        self.model = model
        self.timeout_s = timeout_s
        self._grpc = None
        self._responses: queue.Queue = queue.Queue()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.stop_stream()
            self._grpc.close()
            self._grpc = None

    def model_config(self, model: str) -> dict:
        """A loaded model's configuration as JSON (Triton's ModelConfig field names)."""
        try:
            if self.endpoint.protocol == "grpc":
                return self.grpc_client().get_model_config(model, as_json=True)["config"]
            conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port,
                                              timeout=self.timeout_s)
            try:
                conn.request("GET", f"/v2/models/{model}/config")
                reply = conn.getresponse()
                body = reply.read()
            finally:
                conn.close()
        except QvlError:
            raise
        except OSError as exc:
            raise RequestError(f"{self.endpoint.address}: {exc}") from None
        except Exception as exc:  # tritonclient's InferenceServerException
            raise RequestError(f"{self.endpoint.address}: {_one_line(str(exc))}") from None
        if reply.status != 200:
            raise RequestError(_http_error(reply.status, body))
        return json.loads(body)

    def request_limits(self) -> c.PreprocessingParameters:
        """The deployment's per-request limits, as its preprocessing step's parameters state
        them."""
        names = c.ModelNames() if self.model == c.ENSEMBLE else c.ModelNames.for_build(self.model)
        params = c.config_parameters(self.model_config(names.preprocessing))
        try:
            return c.PreprocessingParameters.from_parameters(
                params, f"{names.preprocessing} on {self.endpoint.address}")
        except ConfigError as exc:
            raise RequestError(f"{exc}; regenerate the repository with `qvl-trt repo`") \
                from None

    def image_token_counter(self) -> Callable[[GenerateRequest], int]:
        """Visual tokens a request's images and videos become on this deployment: its pixel
        bounds applied to each image's size, its video rules to each video's header."""
        limits = self.request_limits()
        return lambda req: sum(image_tokens(data, min_pixels=limits.min_pixels,
                                            max_pixels=limits.max_pixels)
                               for data in req.images) + sum(
            video_file_tokens(data, req.video_fps, limits) for data in req.videos)

    def generate(self, req: GenerateRequest) -> Generation:
        """Send `req` and wait for its last response."""
        sent_at: list[float] = []
        responses = tuple(self.stream(req, sent_at=sent_at))
        return Generation(sent_at[0], responses)

    def stream(self, req: GenerateRequest, *, sent_at: list | None = None) -> Iterator[Response]:
        """Yield the responses of `req` as they arrive; `sent_at`, if given, receives the
        perf_counter time the request went out."""
        if self.endpoint.protocol == "grpc":
            yield from self._stream_grpc(req, sent_at)
        else:
            yield from self._stream_http(req, sent_at)

    # ---- gRPC --------------------------------------------------------------------------

    def grpc_client(self):
        """The tritonclient gRPC client, its response stream started."""
        if self._grpc is None:
            grpc = require("tritonclient.grpc", extra="serve", why="talk to Triton over gRPC")
            self._grpc = grpc.InferenceServerClient(self.endpoint.address)
            # A queue per stream: a dead stream's late callbacks cannot reach the next one.
            responses = self._responses = queue.Queue()
            self._grpc.start_stream(callback=lambda result, error: responses.put(
                (time.perf_counter(), result, error)))
        return self._grpc

    def _stream_grpc(self, req: GenerateRequest, sent_at: list | None) -> Iterator[Response]:
        grpc = require("tritonclient.grpc", extra="serve", why="talk to Triton over gRPC")
        client = self.grpc_client()
        inputs = ensemble_request(req).infer_inputs(grpc.InferInput)
        request_id = uuid.uuid4().hex
        if sent_at is not None:
            sent_at.append(time.perf_counter())
        try:
            client.async_stream_infer(self.model, inputs, request_id=request_id,
                                      enable_empty_final_response=True)
        except Exception as exc:  # the stream broke (server gone); the callback has the cause
            causes = [e for _, _, e in list(self._responses.queue) if e is not None]
            self.close()
            raise RequestError(f"{self.endpoint.address}: "
                               f"{_error_text(causes[0] if causes else exc)}") from None
        while True:
            try:
                received, result, error = self._responses.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                raise RequestError(f"no response from {self.endpoint.address} within "
                                   f"{self.timeout_s:.0f} s") from None
            if error is not None:
                self.close()  # the next request starts a fresh stream
                raise RequestError(_error_text(error))
            response = result.get_response()
            if response.id != request_id:
                continue  # a late response of an abandoned request
            if result.as_numpy(c.TEXT_OUTPUT) is not None:
                yield Response(received, _text(result.as_numpy(c.TEXT_OUTPUT)),
                               _int(result.as_numpy(c.PROMPT_TOKENS)),
                               _int(result.as_numpy(c.COMPLETION_TOKENS)),
                               _text(result.as_numpy(c.FINISH_REASON)),
                               _media(result.as_numpy(c.IMAGE_TOKENS),
                                      result.as_numpy(c.VIDEO_TOKENS)))
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return

    # ---- HTTP --------------------------------------------------------------------------

    def _stream_http(self, req: GenerateRequest, sent_at: list | None) -> Iterator[Response]:
        events = post_events(self.endpoint, f"/v2/models/{self.model}/generate_stream",
                             json.dumps(http_body(req)), {"Content-Type": "application/json"},
                             timeout_s=self.timeout_s, sent_at=sent_at, error_line=_http_error)
        for received, data in events:
            event = json.loads(data)
            if "error" in event:
                raise RequestError(_one_line(event["error"]))
            if c.TEXT_OUTPUT in event:
                yield Response(received, _text(event[c.TEXT_OUTPUT]),
                               _int(event.get(c.PROMPT_TOKENS, 0)),
                               _int(event.get(c.COMPLETION_TOKENS, 0)),
                               _text(event.get(c.FINISH_REASON, "")),
                               _media(event.get(c.IMAGE_TOKENS), event.get(c.VIDEO_TOKENS)))


def post_events(endpoint: Endpoint, path: str, body: str, headers: dict[str, str], *,
                timeout_s: float, sent_at: list | None,
                error_line: Callable[[int, bytes], str]) -> Iterator[tuple[float, bytes]]:
    """POST `body` to `path` and yield (perf_counter arrival time, data) of each server-sent
    event as it arrives; `sent_at`, if given, receives the time the request went out. A
    status other than 200 raises RequestError(error_line(status, body)), a connection error
    one naming the address."""
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)
    try:
        if sent_at is not None:
            sent_at.append(time.perf_counter())
        conn.request("POST", path, body=body, headers=headers)
        reply = conn.getresponse()
        if reply.status != 200:
            raise RequestError(error_line(reply.status, reply.read()))
        for line in reply:
            if line.startswith(b"data:"):
                yield time.perf_counter(), line[5:].strip()
    except OSError as exc:
        raise RequestError(f"{endpoint.address}: {exc}") from None
    finally:
        conn.close()


def _text(value) -> str:
    """A BYTES output as text, whatever nesting (batch/element dims) it arrives in (absent:
    "")."""
    if value is None:
        return ""
    while isinstance(value, (list, np.ndarray)):
        if len(value) == 0:
            return ""
        value = value[0]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value) -> int:
    if value is None:
        return 0
    return int(np.asarray(value).reshape(-1)[0])


def _media(images, videos) -> tuple[int, int] | None:
    """The image_tokens and video_tokens outputs (None from a repository without them)."""
    return None if images is None or videos is None else (_int(images), _int(videos))


def _error_text(error: Exception) -> str:
    """tritonclient's InferenceServerException (or any error) as one line."""
    message = error.message() if hasattr(error, "message") else str(error)
    return _one_line(message)


def _http_error(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return f"HTTP {status}: {_one_line(message)}"


def _one_line(message: str) -> str:
    return " ".join(str(message).split())
