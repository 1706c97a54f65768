"""The gateway's answer cache without a server: which requests it takes, what its key tells
apart, what it keeps and how its bounds (entries, bytes, TTL on an injected clock) push
entries out, each eviction counted by reason. The served side (hits through the real openai
client, the header, the metrics) is in test_gateway_app.py, beside the session's gateway."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.gateway.answer_cache import (
    EVICTED_FOR_AGE,
    AnswerCache,
    CachedAnswer,
    answer_key,
    cacheable,
    no_store,
    request_digest,
)
from qvl_trt.gateway.openai_api import parse_chat_request
from qvl_trt.gateway.options import AnswerCacheOptions
from qvl_trt.gateway.upstream import Build, Piece, ServedModel
from qvl_trt.lru import EVICTED_FOR_BYTES, EVICTED_FOR_ENTRIES

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="


def request(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG}}, {"type": "text", "text": "What?"}]}],
        "temperature": 0, **fields}
    return parse_chat_request(json.dumps({k: v for k, v in body.items() if v is not None})
                              .encode())


def answer(*texts: str, finish: str = "stop", prompt: int = 7) -> list[Piece]:
    return [Piece(t, prompt, i + 1, finish if i == len(texts) - 1 else "")
            for i, t in enumerate(texts)]


# ---- what is cacheable ------------------------------------------------------------------------

@pytest.mark.parametrize("fields, cache_control, opts, expected", [
    ({}, "", {}, True),  # temperature 0: greedy
    ({"temperature": 1e-40}, "", {}, True),  # scales as 0 does in TensorRT-LLM: greedy
    ({"temperature": 0.7, "seed": 3}, "", {}, True),  # sampled, but from a fixed seed
    ({"temperature": 0.7, "top_k": 1}, "", {}, True),
    ({"temperature": 1}, "", {}, False),  # sampled without a seed
    ({"temperature": None}, "", {}, False),  # the checkpoint's default may sample
    ({"answer_cache": False}, "", {}, False),  # the body opts out
    ({}, "no-store", {}, False),
    ({}, "max-age=0, No-Store", {}, False),
    ({}, "no-cache", {}, True),  # only no-store keeps a request out
    ({}, "", {"enabled": False}, False),  # the deployment opts out
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "", {}, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "", {"tools": True}, True),
])
def test_only_deterministic_requests_not_opted_out_are_cacheable(fields, cache_control, opts,
                                                                 expected) -> None:
    assert cacheable(request(**fields), cache_control, AnswerCacheOptions(**opts)) is expected


def test_the_body_field_is_a_boolean() -> None:
    from qvl_trt.gateway.openai_api import ApiError

    with pytest.raises(ApiError, match="answer_cache must be true or false"):
        request(answer_cache="no")
    assert no_store("private, no-store") and not no_store("no-storage")


# ---- the key ----------------------------------------------------------------------------------

def test_the_key_holds_what_shapes_the_answer_and_not_how_it_is_sent() -> None:
    base = request_digest(request())
    # How the answer travels: one entry for streamed and whole answers.
    assert request_digest(request(stream=True, stream_options={"include_usage": True})) == base
    assert request_digest(request(answer_cache=True)) == base
    # Everything that shapes it.
    for fields in ({"max_tokens": 5}, {"seed": 1}, {"stop": ["x"]}, {"top_p": 0.5},
                   {"min_tokens": 1}, {"response_format": {"type": "json_object"}},
                   {"messages": [{"role": "user", "content": "What?"}]},
                   {"mm_processor_kwargs": {"max_pixels": 65536}}):
        assert request_digest(request(**fields)) != base, fields
    # The image's budget (its detail, its part's pixels, the request's): another answer and
    # another usage, so another entry (mm_processor_kwargs left out of the key fails here).
    budgets = [request(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG, "detail": detail}}]}])
        for detail in ("low", "high")]
    budgets += [request(mm_processor_kwargs={"max_pixels": p}) for p in (65536, 262144)]
    budgets.append(request(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG}, "max_pixels": 65536},
        {"type": "text", "text": "What?"}]}]))
    keys = [request_digest(r) for r in budgets]
    assert len({base, *keys}) == 1 + len(keys)
    # An image by its bytes: the same data URL gives the same key, another payload another.
    other = PNG[:-4] + "AAAA"
    assert request_digest(request(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": other}},
        {"type": "text", "text": "What?"}]}])) != base
    # A text that spells what a data URL's digest looks like is not taken for that URL.
    header, payload = PNG.split(",")
    import hashlib

    spelled = f"{header},sha256:{hashlib.sha256(payload.encode()).hexdigest()}"
    assert request_digest(request(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": spelled}},
        {"type": "text", "text": "What?"}]}])) != base


def test_a_remote_image_or_video_url_is_not_cacheable_but_a_url_in_text_is() -> None:
    for part in ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                 {"type": "video", "video": ["HTTP://example.com/1.jpg"]}):
        assert request_digest(request(messages=[{"role": "user", "content": [part]}])) is None
    assert request_digest(request(messages=[
        {"role": "user", "content": "Summarise https://example.com/a.png"}])) is not None


def test_the_key_names_the_scope_the_model_and_each_build() -> None:
    from qvl_trt.triton.contract import ModelNames

    chat, video = (Build(n, ModelNames.for_build(n), None, 8, 4, f"configs of {n}")
                   for n in ("chat", "video"))
    digest = request_digest(request())
    model = ServedModel("ckpt", (chat, video))
    key = answer_key(digest, model)
    assert answer_key(digest, model, scope="tenant-b") != key
    assert answer_key(digest, ServedModel("other", model.builds)) != key
    rebuilt = dataclasses.replace(video, identity="configs of another build")
    assert answer_key(digest, ServedModel("ckpt", (chat, rebuilt))) != key


# ---- what is kept, and the bounds -------------------------------------------------------------

def test_a_kept_answer_replays_its_pieces_and_a_truncated_one_is_not_kept() -> None:
    cache = AnswerCache(AnswerCacheOptions())
    pieces = answer("Hel", "lo, w", "", "orld é")
    assert cache.put("k", "chat", pieces)
    kept = cache.get("k")
    assert kept.pieces() == pieces and kept.build == "chat"
    # with the visual tokens the answer's usage reported
    counted = [dataclasses.replace(p, media_tokens=(60, 0)) for p in pieces]
    assert cache.put("v", "chat", counted) and cache.get("v").pieces() == counted
    assert not cache.put("cut", "chat", answer("a", "b", finish="length"))
    assert cache.get("cut") is None


def test_the_bounds_push_out_the_least_recent_and_count_why() -> None:
    now = [0.0]
    evicted: list[str] = []
    small = sys.getsizeof("a") + CachedAnswer.of("b", answer("x" * 100)).nbytes  # key + answer
    cache = AnswerCache(AnswerCacheOptions(max_entries=3, max_mib=4.5 * small / 2**20,
                                           ttl_s=60),
                        on_evict=evicted.append, clock=lambda: now[0])
    for key in "abc":
        assert cache.put(key, "b", answer("x" * 100))
    assert cache.stats().bytes == 3 * small
    assert cache.get("a") is not None  # a is now the most recent: b goes first
    cache.put("d", "b", answer("x" * 100))
    assert evicted == [EVICTED_FOR_ENTRIES] and cache.get("b") is None
    assert cache.stats().entries == 3
    # An answer of about three small ones: the two least recent go for bytes.
    cache.put("e", "b", answer("x" * 100, "y" * 2 * small))
    assert evicted[1:] == [EVICTED_FOR_BYTES] * 2 and cache.stats().bytes <= 4.5 * small
    assert [k for k in "acde" if cache.get(k) is not None] == ["d", "e"]
    # Too large for the whole cache: not kept, nothing pushed out.
    assert not cache.put("huge", "b", answer("z" * 4 * small))
    assert cache.stats().entries == 2
    # Age: an entry older than the TTL is dropped when asked for.
    now[0] = 59.9
    assert cache.get("d") is not None
    now[0] = 60.0
    assert cache.get("d") is None and evicted[-1] == EVICTED_FOR_AGE
    assert cache.stats().entries == 1


def test_the_gateway_counts_evictions_and_exports_the_size(monkeypatch) -> None:
    """The metrics the dashboard reads, by their names, from the gateway's own registry."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    from qvl_trt.gateway.app import Gateway
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.progress import parse_metrics, total

    gateway = Gateway(GatewayOptions("127.0.0.1:1", answer_cache=AnswerCacheOptions(
        max_entries=1)))
    gateway.answers.put("a", "b", answer("one"))
    gateway.answers.put("b", "b", answer("two"))
    samples = parse_metrics(gateway.metrics.exposition()[0].decode())
    assert total(samples, "qvl_gateway_answer_cache_evictions_total", reason="capacity") == 1
    assert total(samples, "qvl_gateway_answer_cache_entries") == 1
    assert total(samples, "qvl_gateway_answer_cache_bytes") == gateway.answers.stats().bytes > 0


@pytest.mark.parametrize("fields, option", [
    ({"max_entries": 0}, "--answer-cache-entries"), ({"max_mib": 0}, "--answer-cache-mib"),
    ({"ttl_s": -1}, "--answer-cache-ttl")])
def test_a_bound_that_holds_nothing_is_refused_naming_its_option(fields, option) -> None:
    with pytest.raises(ConfigError, match=f"{option} .*--no-answer-cache"):
        AnswerCacheOptions(**fields)


def test_the_gateway_child_gets_the_deployments_switch_and_bounds() -> None:
    """`qvl-trt serve --openai-port` and the tests start the gateway with these flags (the
    session's gateway parses the defaults' spelling)."""
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import gateway_command

    cmd = gateway_command(GatewayOptions("127.0.0.1:8001", answer_cache=AnswerCacheOptions(
        enabled=False, max_entries=7, max_mib=1.5, ttl_s=30, tools=True)))
    flags = cmd[cmd.index("--no-answer-cache"):]
    assert flags == ["--no-answer-cache", "--answer-cache-entries", "7", "--answer-cache-mib",
                     "1.5", "--answer-cache-ttl", "30", "--answer-cache-tools"]
