"""The gateway's web server (aiohttp): routes, limits, streaming, shutdown.

    GET  /                      the chat page (static HTML + JS, no external assets)
    GET  /v1/models             one model per build, by its ensemble's name, or per group of a
                                checkpoint's builds the repository serves as one (by its
                                name; routing.py picks the build of each request), with the
                                checkpoint's name as its `root` (also taken as its id)
    GET  /v1/models/{model}     also the limits it admits, each the largest of its builds'
    POST /v1/chat/completions   OpenAI chat completions, streamed as server-sent events
    GET  /ready                 200 while the deployment answers (readiness.py says when)
    GET  /live                  200 while the gateway runs
    GET  /metrics               Prometheus

API keys: with a keys file (`keys_file`, tenants.py: many keys, each naming a tenant with its
quotas and cache scope; reread when it changes) or one key (`api_key`: the default tenant),
every /v1/ route answers 401 (OpenAI's `invalid_api_key`) unless the request carries
`Authorization: Bearer KEY` of a key it has, as the openai package sends it; the page, /ready,
/live and /metrics stay open (the page asks for the key once and keeps it in the browser tab's
session storage). A tenant past one of its quotas gets 429 in OpenAI's shape naming the quota,
with Retry-After (quotas.py); its requests go to Triton with its cache scope, so its images and
prompts warm no cache of another tenant (contract.CACHE_SCOPE).

Limits: a request body above `max_body_bytes` is refused with 413 before it is read (default:
the largest `max_request_bytes` of the builds' preprocessing models plus room for the other
fields); `max_concurrency` chat requests go on to Triton at once and up to `max_queue` more
wait in the gateway for one, served fairly across tenants (fair_queue.py); more get 429 with
Retry-After (a build that is full refuses a request the same way,
triton/runtime/admission.py). By default (`slot_limits`) a keys file of several tenants
gives the builds' batch slots and their queue places waiting in the gateway, so that the
turns are fair (the builds' own queues are FIFO); else the gateway sends on what the builds
admit, none waiting in it.
A client that goes away (a closed connection) cancels its handler (aiohttp's
handler_cancellation), which cancels its Triton call and so the generation.
Answer cache (answer_cache.py): a deterministic request that repeats an earlier one gets the
stored answer, replayed through the same code as a fresh one; every chat completion's answer
carries the x-qvl-cache header (hit, miss or bypass).
Every error of /v1/ is in OpenAI's shape, also where aiohttp refuses a request before any
route sees it (a malformed request line or header, a header too large, Content-Length
with chunked Transfer-Encoding: `_app_runner`) and for a handler's unexpected exception.
SIGTERM (or Ctrl-C) stops accepting connections, lets the answers in flight finish for up to
`shutdown_timeout_s`, cancels the rest, and exits; a second signal cancels at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import math
import signal
import time
from collections.abc import Callable
from typing import Any

from ..chat_messages import media_counts
from ..deps import require
from ..errors import ConfigError
from ..triton import contract as c
from . import guides, routing, tool_calls
from .answer_cache import (
    CACHE_HEADER,
    AnswerCache,
    CachedAnswer,
    Lookup,
    answer_key,
    cacheable,
    request_digest,
)
from .fair_queue import FairSlots, Full
from .metrics import CLIENT_CLOSED, GatewayMetrics, TokenGaps
from .openai_api import (
    DONE,
    ApiError,
    ChatCompletionRequest,
    ChunkWriter,
    completion,
    completion_id,
    model_card,
    models_list,
    parse_chat_request,
    sse,
    usage,
)
from .options import GatewayOptions
from .quotas import QuotaExceeded, TenantQuota, retry_after_header
from .readiness import LIVE_PATH, READY_PATH, ask_ready, live_reply, ready_reply
from .tenants import ANONYMOUS_TENANT, KEYS_POLL_S, KeyFile, KeyRing, Tenant
from .upstream import PROBE_TIMEOUT_S, Piece, Refusal, ServedModel, Upstream

log = logging.getLogger(__name__)

# Room in a request body beside its messages (settings, JSON punctuation).
BODY_SLACK_BYTES = 64 * 2**10
CHAT_PATH = "/v1/chat/completions"
PAGE = "static/chat.html"


def chat_page() -> bytes:
    return importlib.resources.files(__package__).joinpath(PAGE).read_bytes()


class Gateway:
    """The application's state: the Triton channel, the builds it serves, the metrics."""

    def __init__(self, opts: GatewayOptions) -> None:
        self.web = require("aiohttp.web", extra="gateway", why="run the gateway")
        self.opts = opts
        self.metrics = GatewayMetrics()
        self.served: dict[str, ServedModel] = {}
        self.upstream: Upstream | None = None
        self.slots = FairSlots()
        self.key_file = None if opts.keys_file is None else KeyFile(opts.keys_file)
        if self.key_file is not None:
            self.metrics.keys_generation.set(self.key_file.generation)
        self._single = None if opts.api_key is None else KeyRing.single(opts.api_key)
        self.quotas: dict[str, TenantQuota] = {}
        self.created = int(time.time())
        self._discovery: asyncio.Task | None = None
        self._key_watch: asyncio.Task | None = None
        self._discovery_error = "looking for the builds Triton serves"
        self._page = chat_page()
        self.answers: AnswerCache | None = None
        if opts.answer_cache.enabled:
            evictions = self.metrics.answer_cache_evictions
            self.answers = AnswerCache(opts.answer_cache,
                                       on_evict=lambda reason: evictions.labels(reason).inc())
            self.metrics.answer_cache_entries.set_function(lambda: self.answers.stats().entries)
            self.metrics.answer_cache_bytes.set_function(lambda: self.answers.stats().bytes)

    def app(self):
        web = self.web
        app = web.Application(middlewares=[self._error_middleware()])
        app.add_routes([
            web.get("/", self.page),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post(CHAT_PATH, self.chat),
            web.get(READY_PATH, self.ready),
            web.get(LIVE_PATH, self.live),
            web.get("/metrics", self.metrics_page),
        ])
        app.on_startup.append(self._startup)
        app.on_response_prepare.append(self._cache_header)
        app.on_cleanup.append(self._cleanup)
        return app

    # ---- lifecycle ------------------------------------------------------------------------

    async def _startup(self, app) -> None:
        self.upstream = Upstream(self.opts.triton_url, admin_key=self.opts.triton_admin_key)
        self._discovery = asyncio.create_task(self._discover())
        if self.key_file is not None:
            self._key_watch = asyncio.create_task(self._watch_keys())

    @property
    def keys(self) -> KeyRing | None:
        """The keys asked for (None: none)."""
        return self.key_file.ring if self.key_file is not None else self._single

    async def _watch_keys(self) -> None:
        """Take a rewritten keys file (tenants.py) without a restart."""
        while True:
            await asyncio.sleep(KEYS_POLL_S)
            generation = self.key_file.generation
            problem = self.key_file.poll()
            if problem is not None:
                self.metrics.keys_reload_failures.inc()
                log.error("keys file not reloaded, the keys stay those of generation %d: %s",
                          generation, problem)
            elif self.key_file.generation != generation:
                for name, quota in self.quotas.items():
                    tenant = self.key_file.ring.tenants.get(name)
                    if tenant is not None:
                        quota.update(tenant.quotas)
                self.metrics.keys_generation.set(self.key_file.generation)
                log.info("keys file %s reloaded (generation %d): %d tenants, %d keys",
                         self.key_file.path, self.key_file.generation,
                         len(self.key_file.ring.tenants), len(self.key_file.ring.keys))

    async def _discover(self) -> None:
        """Find the builds Triton serves, trying again each second until it answers (a
        gateway may start before its Triton)."""
        while True:
            try:
                served = await self.upstream.discover()
            except Exception as exc:  # Triton not up yet (or a repository it cannot describe)
                reason = f"Triton at {self.opts.triton_url}: {' '.join(str(exc).split())}"
                if reason != self._discovery_error:
                    log.warning("%s; trying again each second", reason)
                self._discovery_error = reason
            else:
                if served:
                    self.served = served
                    log.info("serving %s from Triton at %s", ", ".join(
                        n if len(m.builds) == 1 else "{} (builds {})".format(
                            n, ", ".join(b.name for b in m.builds))
                        for n, m in served.items()), self.opts.triton_url)
                    return
                self._discovery_error = (f"Triton at {self.opts.triton_url} serves no build "
                                         "with a tensorrt_llm_bls model")
            await asyncio.sleep(1.0)

    async def _cleanup(self, app) -> None:
        for task in (self._discovery, self._key_watch):
            if task is not None:
                task.cancel()
        if self.upstream is not None:
            await self.upstream.close()

    async def _cache_header(self, request, response) -> None:
        """Every chat completion's answer, errors too, says how the answer cache took it."""
        if request.path == CHAT_PATH:
            response.headers[CACHE_HEADER] = request.get(CACHE_HEADER, Lookup.BYPASS).value

    # ---- errors ---------------------------------------------------------------------------

    def _error_middleware(self):
        web = self.web

        @web.middleware
        async def errors(request, handler):
            try:
                if request.path.startswith("/v1/"):
                    request["tenant"] = self._authorize(request)
                return await handler(request)
            except ApiError as exc:
                return self._json(exc.body(), exc.status, _retry_after(exc))
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                # The router's 404 and 405, in OpenAI's shape.
                return self._json(ApiError(exc.status, f"{request.method} {request.path}: "
                                      f"{exc.reason}; see GET /v1/models and POST "
                                      "/v1/chat/completions").body(), exc.status)

        return errors

    def _authorize(self, request) -> Tenant:
        """The tenant of the request's key (the anonymous one where no key is asked)."""
        keys = self.keys
        if keys is None:
            return ANONYMOUS_TENANT
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        tenant = keys.tenant_of(given.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            if request.path == CHAT_PATH:
                self.metrics.requests.labels(ANONYMOUS_TENANT.name, "-", "-", "-", 401).inc()
            raise ApiError(401, "missing or incorrect API key; send the header Authorization: "
                           "Bearer KEY with this server's key (the openai package's api_key)",
                           code="invalid_api_key")
        return tenant

    # ---- small routes ---------------------------------------------------------------------

    def _json(self, body, status: int = 200, headers: dict[str, str] | None = None):
        return self.web.json_response(body, status=status, headers=headers)

    async def page(self, request):
        return self.web.Response(body=self._page, content_type="text/html", charset="utf-8")

    def _card(self, model: ServedModel) -> dict:
        def most(field: str) -> int:
            return max(getattr(b.limits, field) for b in model.builds)

        return model_card(model.name, self.created, model.root, most("max_seq_len"), {
            f: most(f) for f in ("max_input_len", "max_images", "max_videos",
                                 "max_visual_tokens")}, [b.name for b in model.builds])

    async def models(self, request):
        return self._json(models_list([self._card(self.served[n]) for n in sorted(self.served)]))

    async def model(self, request):
        return self._json(self._card(self._model(request.match_info["model"])))

    async def ready(self, request):
        if not self.served:
            ok, reason = False, self._discovery_error
        elif self.opts.ready_url is not None:
            answer = await asyncio.to_thread(ask_ready, self.opts.ready_url, PROBE_TIMEOUT_S)
            ok, reason = answer or (False, f"qvl-trt serve's {self.opts.ready_url} does not "
                                    "answer")
        else:
            ok, reason = await self.upstream.models_ready(self.served)
        status, body = ready_reply(ok, reason)
        return self._json(body, status)

    async def live(self, request):
        status, body = live_reply()
        return self._json(body, status)

    async def metrics_page(self, request):
        body, content_type = self.metrics.exposition()
        response = self.web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    def _not_ready(self) -> ApiError:
        return ApiError(503, f"not ready: {self._discovery_error}", type="server_error",
                        code="unavailable")

    def _model(self, name: str) -> ServedModel:
        """A model by its name, a build of a group by its own (that build alone: to measure
        it), or a model by its checkpoint's name where one model has it."""
        if name in self.served:
            return self.served[name]
        for build in (b for m in self.served.values() for b in m.builds):
            if build.name == name:
                return ServedModel(name, (build,))
        by_root = [m for m in self.served.values() if m.root == name]
        if len(by_root) == 1:
            return by_root[0]
        if by_root:
            raise ApiError(404, f"the model {name!r} names the checkpoint of "
                           f"{', '.join(m.name for m in by_root)}; send one of these names",
                           param="model", code="model_not_found")
        if not self.served:
            raise self._not_ready()
        raise ApiError(404, f"the model {name!r} does not exist; this server has "
                       f"{', '.join(sorted(self.served))} (GET /v1/models)", param="model",
                       code="model_not_found")

    # ---- chat completions -----------------------------------------------------------------

    @property
    def body_limit(self) -> int:
        """--max-body-bytes, else the builds' largest max_request_bytes and some room; before
        the builds are known, a request gets 503 as it would once read."""
        if self.opts.max_body_bytes is not None:
            return self.opts.max_body_bytes
        if not self.served:
            raise self._not_ready()
        return max(b.limits.max_request_bytes for m in self.served.values()
                   for b in m.builds) + BODY_SLACK_BYTES

    async def _body(self, request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit."""
        limit = self.body_limit
        too_large = ApiError(413, f"the request body is above this server's limit of {limit} "
                             "bytes (--max-body-bytes); send smaller or fewer images",
                             code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    @property
    def slot_limits(self) -> tuple[int, int] | None:
        """(slots, waiting places), None before the builds are known (no limit). Given
        --max-concurrency: it and --max-queue (default none). Else with tenants to be fair
        between (a keys file of two or more): the builds' batch slots, and their queue places
        waiting here, where the turns are fair (the builds' own queues are FIFO); else what the
        builds admit, none waiting here (--max-queue: that many)."""
        o = self.opts
        if o.max_concurrency is not None:
            return o.max_concurrency, o.max_queue or 0
        capacity = sum(m.capacity for m in self.served.values())
        if not capacity:
            return None
        if self.keys is not None and len(self.keys.tenants) > 1:
            slots = sum(m.batch_slots for m in self.served.values())
            return slots, capacity - slots if o.max_queue is None else o.max_queue
        return capacity, o.max_queue or 0

    def _quota(self, tenant: Tenant) -> TenantQuota:
        if tenant.name not in self.quotas:
            self.quotas[tenant.name] = TenantQuota(tenant.quotas)
        return self.quotas[tenant.name]

    async def chat(self, request):
        received = time.perf_counter()
        tenant: Tenant = request["tenant"]
        # The request's metric labels, filled in as they are known; `build`: the last asked.
        labels = {"tenant": tenant.name, "model": "-", "build": "-", "stream": "-"}
        status = 500
        try:
            quota = self._quota(tenant)
            try:
                quota.admit()
            except QuotaExceeded as exc:
                self.metrics.quota_refusals.labels(tenant.name, exc.limit).inc()
                raise ApiError(429, f"tenant {tenant.name!r} is at its {exc} (its keys file's "
                               f"quota); retry after {math.ceil(exc.retry_after_s)} s",
                               type="tokens" if exc.limit == "tokens_per_minute" else
                               "requests", param=exc.limit, code="rate_limit_exceeded",
                               retry_after_s=exc.retry_after_s) from None
            spent = request["spent"] = Spent()
            try:
                response, status = await self._in_slot(request, tenant, received, labels)
                return response
            finally:
                quota.release(spent.tokens)
        except ApiError as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED  # the client went away: its Triton call is cancelled
            raise
        finally:
            self.metrics.requests.labels(**labels, status=status).inc()

    async def _in_slot(self, request, tenant: Tenant, received: float, labels: dict[str, str]):
        """(the response, its status), once one of the gateway's slots is the request's
        (fair_queue.py)."""
        limits = self.slot_limits
        if limits is not None:
            self.metrics.waiting.inc()
            try:
                await self.slots.enter(tenant.name, *limits)
            except Full:
                waiting = self.slots.waiting
                raise ApiError(429, f"{self.slots.in_slots} requests are being answered"
                               f"{f' and {waiting} wait' if waiting else ''}, the limit of "
                               "this gateway (--max-concurrency and --max-queue, by default "
                               "what the builds admit); retry shortly",
                               type="rate_limit_exceeded", code="rate_limit_exceeded") from None
            finally:
                self.metrics.waiting.dec()
        self.metrics.in_flight.inc()
        try:
            # In a worker thread: the walks over a large body (its texts, nesting and
            # schemas) then share the GIL with the event loop instead of holding it.
            req = await asyncio.to_thread(parse_chat_request, await self._body(request))
            labels["stream"] = "true" if req.stream else "false"
            model = self._model(req.model)
            labels["model"] = model.name
            key = await self._answer_key(request, model, req)
            hit = self.answers.get(key) if key is not None else None
            lookup = Lookup.BYPASS if key is None else Lookup.MISS if hit is None else Lookup.HIT
            request[CACHE_HEADER] = lookup
            self.metrics.answer_cache_lookups.labels(model.name, lookup.value).inc()
            # A hit needs no guide: its answer was checked against the structure when made.
            guide = await guides.guide(req.structure) if hit is None else None
            answer = self._stream if req.stream else self._complete
            # Where a fresh answer is stored (a hit's is there already).
            store = key if hit is None else None
            return await answer(request, model, req, guide, received, labels, store, hit)
        finally:
            self.metrics.in_flight.dec()
            if limits is not None:
                self.slots.leave(tenant.name, limits[0])

    async def _answer_key(self, request, model: ServedModel,
                          req: ChatCompletionRequest) -> str | None:
        """The request's answer-cache key within its tenant's cache scope, or None: not to
        be looked up nor stored."""
        if self.answers is None or not cacheable(
                req, request.headers.get("Cache-Control", ""), self.answers.opts):
            return None
        digest = await asyncio.to_thread(request_digest, req)  # hashes the data URLs
        return None if digest is None else answer_key(digest, model,
                                                      request["tenant"].cache_scope)

    def _answered(self, request, model: ServedModel, stream: bool, received: float,
                  last: Piece, hit: CachedAnswer | None) -> None:
        """The metrics of an answer; a hit's tokens were not generated, and count once."""
        m, tenant = self.metrics, request["tenant"].name
        m.latency.labels(model.name, "true" if stream else "false").observe(
            time.perf_counter() - received)
        if hit is None:
            m.prompt_tokens.labels(tenant, model.name).inc(last.prompt_tokens)
            m.completion_tokens.labels(tenant, model.name).inc(last.completion_tokens)

    def _keep(self, store: str | None, labels: dict[str, str], pieces: list[Piece]) -> None:
        """Store a fresh answer that went out whole under its key `store` (None: not to be
        stored); the cache refuses one cut short."""
        if store is not None:
            self.answers.put(store, labels["build"], pieces)

    async def _pieces(self, request, model: ServedModel, req: ChatCompletionRequest,
                      guide: tuple[str, str] | None, labels: dict[str, str],
                      received: float, hit: CachedAnswer | None):
        """(the rest of the pieces, the first piece, what counts the gaps between them): a
        hit's, replayed (no gaps counted: nothing was generated; its tokens are charged to
        the tenant's quota all the same), or the deployment's."""
        if hit is not None:
            labels["build"] = hit.build
            pieces = hit.replay()
            return pieces, request["spent"].piece(await anext(pieces)), None
        pieces, first = await self._first_piece(request, model, req, guide, labels)
        return pieces, first, self._first_token(model, received, first)

    def _first_token(self, model: ServedModel, received: float, first: Piece) -> TokenGaps:
        """The time to the first piece observed; what counts the gaps after it."""
        self.metrics.ttft.labels(model.name).observe(time.perf_counter() - received)
        return TokenGaps(self.metrics.inter_token.labels(model.name), first.completion_tokens)

    async def _first_piece(self, request, model: ServedModel, req: ChatCompletionRequest,
                           guide: tuple[str, str] | None, labels: dict[str, str]):
        """(the pieces of the build that answers, its first piece), before anything goes to
        the client: the build routing.py chooses, or where it refuses the request above its
        engine limits, once, the larger build routing.py names."""
        images, videos = media_counts(req.messages)
        build = routing.choose(model, images, videos)
        labels["build"] = build.name
        scope, spent = request["tenant"].cache_scope, request["spent"]
        pieces = self.upstream.generate(build, req, guide, scope)
        try:
            return pieces, spent.piece(await anext(pieces))
        except Refusal as exc:  # the generator ended with it
            larger = routing.larger(model, build, images, videos) \
                if exc.kind is c.ErrorKind.ENGINE_LIMIT else None
            if larger is None:
                raise
        self.metrics.rerouted.labels(model.name, build.name).inc()
        labels["build"] = larger.name
        pieces = self.upstream.generate(larger, req, guide, scope)
        return pieces, spent.piece(await anext(pieces))

    async def _complete(self, request, model: ServedModel, req: ChatCompletionRequest,
                        guide: tuple[str, str] | None, received: float,
                        labels: dict[str, str], store: str | None, hit: CachedAnswer | None):
        pieces, last, gaps = await self._pieces(request, model, req, guide, labels, received,
                                                hit)
        got, spent = [last], request["spent"]
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                if gaps is not None:
                    gaps.piece(piece.completion_tokens)
                got.append(piece)
                last = spent.piece(piece)
        text = "".join(p.text for p in got)
        await asyncio.to_thread(guides.check_answer, req.structure, text, last.finish_reason)
        self._answered(request, model, False, received, last, hit)
        self._keep(store, labels, got)
        answer = tool_calls.reader(req.structure)
        deltas = answer.feed(text) + answer.close()
        body = completion(completion_id(), int(time.time()), model.name,
                          tool_calls.message(deltas),
                          tool_calls.finish_reason(last.finish_reason, answer.calls),
                          _usage(last))
        return self._json(body), 200

    async def _stream(self, request, model: ServedModel, req: ChatCompletionRequest,
                      guide: tuple[str, str] | None, received: float,
                      labels: dict[str, str], store: str | None, hit: CachedAnswer | None):
        """Server-sent events. The first piece is awaited before the headers go out, so a
        refused request (a bad image, a prompt too long) gets its HTTP status (or another
        build: _first_piece); an error after that comes as an error event before [DONE]."""
        pieces, piece, gaps = await self._pieces(request, model, req, guide, labels, received,
                                                 hit)
        got: list[Piece] = []
        spent = request["spent"]
        async with contextlib.aclosing(pieces):
            response = self.web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})  # nginx: do not buffer the stream
            await response.prepare(request)
            writer = ChunkWriter(model.name, include_usage=req.include_usage,
                                 continuous_usage=req.continuous_usage)
            await response.write(writer.event({"role": "assistant", "content": ""},
                                              counts=_usage(piece, 0)))
            answer = tool_calls.reader(req.structure)
            try:
                while piece is not None:
                    last = piece
                    got.append(piece)
                    counts = _usage(piece)
                    for delta in answer.feed(piece.text):
                        await response.write(writer.event(delta.chunk(), counts=counts))
                    piece = await anext(pieces, None)
                    if piece is not None:
                        spent.piece(piece)
                    if piece is not None and gaps is not None:
                        gaps.piece(piece.completion_tokens)
                await asyncio.to_thread(guides.check_answer, req.structure,
                                        "".join(p.text for p in got), last.finish_reason)
            except ApiError as exc:  # instead of the finish reason
                await response.write(sse(exc.body()) + DONE)
                return response, exc.status
        counts = _usage(last)
        tail = b"".join(writer.event(delta.chunk(), counts=counts) for delta in answer.close())
        tail += writer.event({}, tool_calls.finish_reason(last.finish_reason, answer.calls),
                             counts=counts)
        if req.include_usage:
            tail += writer.usage_event(counts)
        await response.write(tail + DONE)
        await response.write_eof()
        self._answered(request, model, True, received, last, hit)
        self._keep(store, labels, got)
        return response, 200


class Spent:
    """A request's tokens so far (prompt + completion), from its latest piece."""

    tokens = 0

    def piece(self, piece: Piece) -> Piece:
        self.tokens = piece.prompt_tokens + piece.completion_tokens
        return piece


def _usage(piece: Piece, completion_tokens: int | None = None) -> dict[str, Any]:
    """The usage a piece reports (`completion_tokens`: in its place)."""
    return usage(piece.prompt_tokens, piece.completion_tokens if completion_tokens is None
                 else completion_tokens, piece.media_tokens)


def _retry_after(exc: ApiError) -> dict[str, str] | None:
    if exc.status not in (429, 503):
        return None
    return {"Retry-After": retry_after_header(exc.retry_after_s or 1)}


# ---- running it -------------------------------------------------------------------------------

def _app_runner(web):
    """aiohttp's AppRunner whose connections answer in OpenAI's error shape what aiohttp
    answers itself: its HTTP parser's refusals (400, 413, 431, ...) and a handler's uncaught
    exception (500) reach RequestHandler.handle_error, never the application's middleware
    (aiohttp web_protocol.py: `_make_error_handler`, `_handle_request`)."""
    from aiohttp import web_protocol

    class ShapedErrors(web_protocol.RequestHandler):
        def handle_error(self, request, status=500, exc=None, message=None):
            plain = super().handle_error(request, status, exc, message)  # logs it
            if status >= 500:  # the exception's text is the log's, not the client's
                cause = f" ({type(exc).__name__})" if exc is not None else ""
                message = f"internal error of the gateway{cause}; see its log"
            error = ApiError(status, f"{plain.reason}: {message or plain.reason}",
                             type="server_error" if status >= 500 else "invalid_request_error")
            shaped = web.json_response(error.body(), status=status)
            shaped.force_close()  # as aiohttp's own answer: the connection cannot go on
            return shaped

    class Server(web.Server):
        def __call__(self):
            return ShapedErrors(self, loop=self._loop, **self._kwargs)

    class Runner(web.AppRunner):
        async def _make_server(self):
            plain = await super()._make_server()  # starts the application
            return Server(plain.request_handler, request_factory=plain.request_factory,
                          handler_cancellation=plain.handler_cancellation,
                          loop=asyncio.get_running_loop(), **plain._kwargs)

    return Runner


def run_gateway(opts: GatewayOptions, on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C (see the module doc); `on_ready` is called once the port
    is open."""
    with contextlib.suppress(asyncio.CancelledError):  # a second signal
        asyncio.run(_serve(opts, on_ready))


async def _serve(opts: GatewayOptions, on_ready: Callable[[], None] | None) -> None:
    web = require("aiohttp.web", extra="gateway", why="run the gateway")
    runner = _app_runner(web)(Gateway(opts).app(), handler_cancellation=True,
                              shutdown_timeout=opts.shutdown_timeout_s, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, opts.host, opts.port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {opts.host}:{opts.port} ({exc.strerror}); "
                              "pick another --port") from None
        stop = asyncio.Event()
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                main.cancel()  # a second signal: do not wait for the answers in flight
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("stopping: finishing the answers in flight (up to %.0f s)",
                 opts.shutdown_timeout_s)
    finally:
        await runner.cleanup()
