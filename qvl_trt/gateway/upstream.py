"""The gateway's side of Triton: which builds it serves, as which models (`discover`), whether
their models are ready (`models_ready`), and one chat request to one build as a stream of text
pieces (`generate`), over tritonclient's asyncio gRPC client.

Every request goes to the build's `tensorrt_llm_bls` model, not its `ensemble`: the same
inputs, outputs and answers, but the request a client cancels is that model's own, so it stops
tensorrt_llm (Triton's ensemble scheduler does not pass a cancel to a step already running:
docs/triton.md, "Cancelling a request"). A client that goes away cancels the gRPC call, and with it
the generation. Triton is always asked to stream, also for a non-streamed answer: the model
looks for the cancel between tokens, and the streamed pieces add up to the one-shot text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from ..chat_messages import MM_PROCESSOR_KWARGS
from ..deps import require
from ..errors import InputError
from ..hashing import fingerprint
from ..triton import contract as c
from ..triton.restricted import grpc_headers
from .openai_api import ApiError, ChatCompletionRequest

log = logging.getLogger(__name__)

# What a readiness or discovery call may take before Triton counts as not answering.
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Build:
    """One build of the repository, by its ensemble's name."""

    name: str
    models: c.ModelNames
    limits: c.PreprocessingParameters  # its preprocessing model's parameters
    # The requests its tensorrt_llm_bls admits at once: tensorrt_llm's batch slots and the
    # places of its queue (triton/runtime/admission.py).
    capacity: int
    batch_slots: int  # of them, those that generate at once
    # sha256 of its models' configs as Triton reports them (its manifest's cache key, the
    # build's inputs by content, is among preprocessing's parameters): the answer cache's
    # name for what answers.
    identity: str = ""


@dataclass(frozen=True)
class ServedModel:
    """One OpenAI model: a build alone, by its ensemble's name, or the builds of one
    checkpoint that the repository serves as one (their preprocessing's served_name), of
    which routing.py picks one per request."""

    name: str
    builds: tuple[Build, ...]

    @property
    def root(self) -> str:
        """The checkpoint's name (a repository written before it was recorded: the name)."""
        return self.builds[0].limits.checkpoint_name or self.name

    @property
    def capacity(self) -> int:
        return sum(b.capacity for b in self.builds)

    @property
    def batch_slots(self) -> int:
        return sum(b.batch_slots for b in self.builds)


def served_models(builds: Iterable[Build]) -> dict[str, ServedModel]:
    """The builds by the model they serve."""
    grouped: dict[str, list[Build]] = {}
    for build in builds:
        grouped.setdefault(build.limits.served_name or build.name, []).append(build)
    return {name: ServedModel(name, tuple(group)) for name, group in grouped.items()}


@dataclass(frozen=True)
class Piece:
    """One response of the model: new text, the token counts so far and, in the last one,
    why the answer ended ("stop" or "length"; "" before)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    # The prompt's (image, video) tokens; None from a repository that does not report them.
    media_tokens: tuple[int, int] | None = None


# The HTTP answer to each kind of error response: (status, OpenAI's error type, code).
_STATUS = {c.ErrorKind.REQUEST: (400, "invalid_request_error", None),
           c.ErrorKind.LIMIT: (413, "invalid_request_error", "request_too_large"),
           c.ErrorKind.ENGINE_LIMIT: (400, "invalid_request_error", None),
           c.ErrorKind.BUSY: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
           c.ErrorKind.UNAVAILABLE: (503, "server_error", "unavailable"),
           c.ErrorKind.INTERNAL: (500, "server_error", None)}


class Refusal(ApiError):
    """An error response of the deployment, with its kind."""

    def __init__(self, kind: c.ErrorKind, message: str) -> None:
        status, type_, code = _STATUS[kind]
        super().__init__(status, message, type=type_, code=code)
        self.kind = kind


def refusal(message: str) -> Refusal:
    """An error response of the deployment -> the HTTP answer for its kind: the request's to
    fix 400 (above the build's engine limits too), above a size bound 413, a build whose
    batch slots and queue are full 429, a model that is not there right now 503, a bug 500."""
    message = " ".join(message.split())
    return Refusal(c.ErrorKind.of_message(message), message)


def _piece(response: Any) -> Piece | None:
    """The text and counts of one ModelInferResponse, read from its raw output contents, or
    None for a response without text. Once per token, so straight from the bytes rather than
    through numpy: Triton's gRPC endpoint sends every output as raw contents, little-endian,
    a BYTES element as a 4-byte length and the bytes (what tritonclient's
    grpc/_infer_result.py as_numpy decodes)."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents,
                   strict=True))
    text = raw.get(c.TEXT_OUTPUT)
    if text is None:
        return None
    images, videos = raw.get(c.IMAGE_TOKENS), raw.get(c.VIDEO_TOKENS)
    return Piece(_string(text), _int32(raw[c.PROMPT_TOKENS]), _int32(raw[c.COMPLETION_TOKENS]),
                 _string(raw[c.FINISH_REASON]),
                 None if images is None or videos is None else (_int32(images), _int32(videos)))


def _int32(raw: bytes) -> int:
    """An INT32 output of one element."""
    return int.from_bytes(raw, "little", signed=True)


def _string(raw: bytes) -> str:
    """A BYTES output of one element."""
    size = int.from_bytes(raw[:4], "little")
    return raw[4:4 + size].decode("utf-8", "replace")


def _ensemble_request(request: ChatCompletionRequest, guide: tuple[str, str] | None = None,
                      scope: str = "") -> c.EnsembleRequest:
    """The ensemble's request for a chat request, always streamed (see the module doc);
    absent settings are left to the deployment's defaults. `guide`: (type, guide) of guided
    decoding (guides.py); `scope`: the tenant's cache scope ("": the shared one, sent as no
    input, so a repository written before the input existed still answers)."""
    tools = request.structure.tools
    guide_type, guide_text = guide or (None, None)
    # Request-wide budgets travel in a body around the messages (runtime/request_inputs.py);
    # without them, the messages alone, as a repository written before them reads them.
    chat: Any = request.messages if request.mm_processor_kwargs is None else {
        "messages": request.messages, MM_PROCESSOR_KWARGS: request.mm_processor_kwargs}
    return c.EnsembleRequest(
        messages=json.dumps(chat, ensure_ascii=False),
        tools=None if tools is None else json.dumps(tools, ensure_ascii=False),
        max_tokens=request.max_tokens,
        min_tokens=request.min_tokens, ignore_eos=request.ignore_eos or None,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        seed=request.seed, stop=request.stop, stream=True,
        guided_decoding_guide_type=guide_type, guided_decoding_guide=guide_text,
        cache_scope=scope or None)


# gRPC reconnects to a server that went away with an exponential backoff of up to 120 s
# (grpc's doc/connection-backoff.md): after serve restarted Triton the gateway would answer
# 503 for that long though the server is back. A second is the most it waits here.
RECONNECT_BACKOFF_MS = 1000


def _channel_args(grpc_client: Any) -> list[tuple[str, int]]:
    """tritonclient's channel options (channel_args replaces them all: its
    grpc/aio/__init__.py) with a short reconnect backoff."""
    keepalive = grpc_client.KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", grpc_client.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpc_client.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ]


class Upstream:
    """One gRPC channel to Triton, shared by every request (create it inside the event loop
    that uses it)."""

    def __init__(self, url: str, *, admin_key: str | None = None) -> None:
        self.url = url
        self._admin = grpc_headers(admin_key)
        self._grpc = require("tritonclient.grpc", extra="gateway", why="talk to Triton")
        aio = require("tritonclient.grpc.aio", extra="gateway", why="talk to Triton")
        # What a broken stream raises (tritonclient's stream iterator does not wrap it).
        self._rpc_error = require("grpc", extra="gateway", why="talk to Triton").aio.AioRpcError
        self.client = aio.InferenceServerClient(url, channel_args=_channel_args(self._grpc))

    async def close(self) -> None:
        await self.client.close()

    def unreachable(self, exc: BaseException) -> ApiError:
        detail = " ".join(str(exc.details() if hasattr(exc, "details") else exc).split())
        return ApiError(503, f"Triton at {self.url} is not reachable ({detail}); retry once it "
                        "is back", type="server_error", code="unavailable")

    async def discover(self) -> dict[str, ServedModel]:
        """The models Triton serves, of its builds: every ensemble that has its
        tensorrt_llm_bls model."""
        index = await self.client.get_model_repository_index(
            headers=self._admin, as_json=True, client_timeout=PROBE_TIMEOUT_S)
        names = {m["name"] for m in index.get("models", [])}
        builds = []
        for name in sorted(names):
            models = c.ModelNames.for_build(None if name == c.ENSEMBLE else name)
            if models.tensorrt_llm_bls not in names or models.preprocessing not in names:
                continue
            if (await self._config(name)).get("platform") != "ensemble":
                continue
            configs = {m: await self._config(m) for m in models.all()}
            limits = c.PreprocessingParameters.from_parameters(
                c.config_parameters(configs[models.preprocessing]),
                f"{models.preprocessing} on {self.url}")
            caller = c.TensorrtLlmBlsParameters.from_parameters(
                c.config_parameters(configs[models.tensorrt_llm_bls]),
                f"{models.tensorrt_llm_bls} on {self.url}")
            builds.append(Build(name, models, limits, caller.capacity, caller.batch_slots,
                                fingerprint(configs)))
        return served_models(builds)

    async def _config(self, model: str) -> dict[str, Any]:
        reply = await self.client.get_model_config(model, as_json=True,
                                                   client_timeout=PROBE_TIMEOUT_S)
        return reply["config"]

    async def models_ready(self, served: dict[str, ServedModel]) -> tuple[bool, str]:
        """(ready, reason): Triton answers ready and so does every model of every build."""
        try:
            if not await self.client.is_server_ready(client_timeout=PROBE_TIMEOUT_S):
                return False, f"Triton at {self.url} is not ready"
            if not served:
                return False, f"Triton at {self.url} serves no build with tensorrt_llm_bls"
            # Every build of a model of several: each takes requests the others refuse.
            for name in (n for m in served.values() for b in m.builds for n in b.models.all()):
                if not await self.client.is_model_ready(name, client_timeout=PROBE_TIMEOUT_S):
                    return False, f"model {name} is not ready"
        except self._grpc.InferenceServerException as exc:
            return False, self.unreachable(exc).message
        return True, "ready"

    async def generate(self, build: Build, request: ChatCompletionRequest,
                       guide: tuple[str, str] | None = None,
                       scope: str = "") -> AsyncIterator[Piece]:
        """The build's responses as they arrive, at least one (`guide`, `scope`: see
        _ensemble_request). Raises a Refusal for an error response, ApiError for a lost
        connection. Leaving early (the caller stops iterating, or is
        cancelled) cancels the call: the model sees its request cancelled and stops
        generating."""
        closed = asyncio.Event()
        try:  # encoded here, not inside the call's request stream, which would cancel it
            inputs = _ensemble_request(request, guide, scope).infer_inputs(
                self._grpc.InferInput)
        except InputError as exc:
            raise ApiError(400, str(exc)) from None

        async def requests():
            yield {"model_name": build.models.tensorrt_llm_bls, "inputs": inputs}
            await closed.wait()  # the stream stays open until the answer is complete

        call = self.client.stream_infer(requests())
        finished = answered = False
        try:
            async for result, error in call:
                if error is not None:
                    raise refusal(error.message())
                response = result.get_response()
                piece = _piece(response)
                if piece is not None:
                    answered = True
                    yield piece
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    break
            if not (finished and answered):
                raise ApiError(502, f"{build.models.tensorrt_llm_bls} on {self.url} ended "
                               "the stream without a complete answer", type="server_error")
        except self._rpc_error as exc:
            raise self.unreachable(exc) from None
        finally:
            closed.set()
            if not finished:
                call.cancel()
