"""The answer cache: a deterministic answer, kept in the gateway's memory, answers the same
request again without generating it.

Cacheable (`cacheable`): a request whose answer the deployment computes the same each time
(greedy: temperature 0 or top_k 1; or sampled with a fixed seed), with `tools` only where the
deployment allows it (`AnswerCacheOptions.tools`), and not opted out (the body's
`"answer_cache": false`, or `Cache-Control: no-store`). Any other is a bypass: neither looked up
nor stored.

The key (`request_digest`, `answer_key`): sha256 over the scope (the tenant: one scope until API
keys name tenants), the model, the identity of every build of the model (each build's model
configs as Triton reports them, its manifest's cache key among them: the build that answers
depends on the request's size, found only in preprocessing), and every field of the request
that shapes the answer: the messages, with each `data:` URL's payload by its sha256, the
sampling settings, max_tokens, stop, min_tokens, ignore_eos, response_format, tools and
tool_choice. How the answer is sent (stream, stream_options) is not in it: a streamed
request and a whole one share an entry. An image or video behind a remote URL makes the
request a bypass: the gateway does not see the bytes, which may change.

Stored (`AnswerCache.put`): the build's pieces of text as Triton sent them, with their token
counts, once the whole answer went out; never an error, a refusal, a cancelled request or an
answer cut at max_tokens (finish reason "length"). A hit replays the pieces through the same
code as a fresh answer: the same content, finish reason and usage, a stream in the same
chunks; the response's `id`, `created` (and a tool call's id) are new, as each response's
are (OpenAI's: an id names one response).

Bounded in entries and bytes (least recently used out first) and in age (an entry older than
the TTL is dropped when next asked for); each eviction is counted by its reason.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..chat_messages import IMAGE_PART_TYPES, VIDEO_PART_TYPES
from ..hashing import fingerprint
from ..llm.sampling import FinishReason, scales_as_greedy
from ..lru import BytesLru, CacheStats
from .openai_api import ChatCompletionRequest
from .options import AnswerCacheOptions
from .upstream import Piece, ServedModel

# The response header of every chat completion: how the cache took the request.
CACHE_HEADER = "x-qvl-cache"
# The scope of every entry until API keys name tenants (then: the key's tenant).
DEFAULT_SCOPE = ""
# Why an entry was dropped beside the LRU's bounds (lru.EVICTED_FOR_ENTRIES, _FOR_BYTES).
EVICTED_FOR_AGE = "ttl"
# The request's fields that say how the answer is sent, not what it is.
_FRAMING = ("stream", "include_usage", "continuous_usage", "answer_cache")
_MEDIA = (*IMAGE_PART_TYPES, *VIDEO_PART_TYPES)


class Lookup(str, enum.Enum):
    """How the cache took a request (the header's value, the lookups metric's `result`)."""

    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"  # not cacheable, opted out, or the cache is off


def no_store(cache_control: str) -> bool:
    """Whether a Cache-Control header holds the no-store directive (RFC 9111 5.2.1.5)."""
    return any(d.split("=", 1)[0].strip().lower() == "no-store"
               for d in cache_control.split(","))


def deterministic(req: ChatCompletionRequest) -> bool:
    """Greedy (temperature 0 as TensorRT-LLM computes it, or top_k 1), or seeded. A request
    that leaves temperature out gets the checkpoint's default, which may sample."""
    greedy = req.top_k == 1 or (req.temperature is not None
                                and scales_as_greedy(req.temperature))
    return greedy or req.seed is not None


def cacheable(req: ChatCompletionRequest, cache_control: str,
              opts: AnswerCacheOptions) -> bool:
    return (opts.enabled and req.answer_cache and not no_store(cache_control)
            and deterministic(req) and (opts.tools or not req.structure.tools))


class _RemoteMedia(Exception):
    pass


def _digested(value: Any, media: bool = False) -> Any:
    """`value` with every string that starts with `data:` as its header and the sha256 of its
    payload: one-to-one, since every such string is replaced. A remote URL in an image or
    video part raises _RemoteMedia. Recursive: parsing bounded the depth (MAX_JSON_DEPTH)."""
    if isinstance(value, str):
        if value.startswith("data:"):
            header, _, payload = value.partition(",")
            return f"{header},sha256:{hashlib.sha256(payload.encode()).hexdigest()}"
        if media and value[:8].lower().startswith(("http://", "https://")):
            raise _RemoteMedia
        return value
    if isinstance(value, list):
        return [_digested(v, media) for v in value]
    if isinstance(value, Mapping):
        media = media or value.get("type") in _MEDIA
        return {k: _digested(v, media) for k, v in value.items()}
    return value


def request_digest(req: ChatCompletionRequest) -> str | None:
    """sha256 of what the request asks (see the module doc), or None where an image or video
    is behind a remote URL. Hashes every data URL: run it off the event loop."""
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)
              if f.name not in _FRAMING}
    try:
        fields["messages"] = _digested(req.messages)
    except _RemoteMedia:
        return None
    fields["structure"] = dataclasses.asdict(req.structure)
    return fingerprint(fields)


def answer_key(digest: str, model: ServedModel, scope: str = DEFAULT_SCOPE) -> str:
    """The entry of a request (its `request_digest`) to `model` within `scope`."""
    return fingerprint({"scope": scope, "model": model.name,
                        "builds": [b.identity for b in model.builds], "request": digest})


@dataclass(frozen=True)
class CachedAnswer:
    """A build's pieces of one answer, packed: their texts joined, and per piece where its
    text ends and its token counts."""

    build: str
    text: str
    ends: array
    prompt_tokens: array
    completion_tokens: array
    finish_reason: str
    media_tokens: tuple[int, int] | None = None  # the prompt's, as every piece reports them

    @classmethod
    def of(cls, build: str, pieces: Sequence[Piece]) -> CachedAnswer:
        ends, end = array("q"), 0
        for piece in pieces:
            end += len(piece.text)
            ends.append(end)
        return cls(build, "".join(p.text for p in pieces), ends,
                   array("q", (p.prompt_tokens for p in pieces)),
                   array("q", (p.completion_tokens for p in pieces)),
                   pieces[-1].finish_reason, pieces[-1].media_tokens)

    def pieces(self) -> list[Piece]:
        starts = (0, *self.ends[:-1])
        last = len(self.ends) - 1
        return [Piece(self.text[a:b], p, n, self.finish_reason if i == last else "",
                      self.media_tokens)
                for i, (a, b, p, n) in enumerate(zip(starts, self.ends, self.prompt_tokens,
                                                     self.completion_tokens, strict=True))]

    async def replay(self) -> AsyncIterator[Piece]:
        for piece in self.pieces():
            yield piece

    @property
    def nbytes(self) -> int:
        """What it holds in memory: its text, its arrays and itself."""
        return sys.getsizeof(self) + sum(sys.getsizeof(v) for v in (
            self.text, self.ends, self.prompt_tokens, self.completion_tokens))


class AnswerCache:
    """Answers by key, bounded by `opts` (entries, bytes, TTL). `on_evict(reason)`: each entry
    dropped by a bound (lru.EVICTED_FOR_ENTRIES, lru.EVICTED_FOR_BYTES, EVICTED_FOR_AGE);
    `clock`: seconds, monotonic."""

    def __init__(self, opts: AnswerCacheOptions, *,
                 on_evict: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts = opts
        self._clock = clock
        self._on_evict = on_evict
        self._lru: BytesLru[str, tuple[float, CachedAnswer]] = BytesLru(
            opts.max_bytes, lambda key, entry: sys.getsizeof(key) + entry[1].nbytes,
            max_entries=opts.max_entries, on_evict=on_evict)

    def get(self, key: str) -> CachedAnswer | None:
        entry = self._lru.get(key)
        if entry is None:
            return None
        stored, answer = entry
        if self._clock() - stored >= self.opts.ttl_s:
            self._lru.pop(key)
            self._on_evict(EVICTED_FOR_AGE)
            return None
        return answer

    def put(self, key: str, build: str, pieces: Sequence[Piece]) -> bool:
        """Keep a complete answer (it ended by itself: finish reason "stop"); False where it
        is not kept (cut at max_tokens, or larger than the whole cache)."""
        if not pieces or pieces[-1].finish_reason != FinishReason.STOP:
            return False
        return self._lru.put(key, (self._clock(), CachedAnswer.of(build, pieces)))

    def stats(self) -> CacheStats:
        return self._lru.stats()
