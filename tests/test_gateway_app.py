"""The OpenAI-compatible gateway over the session's real tritonserver (the reference flavor of
the tiny checkpoint), with the real `openai` package as the client: its answers are the
ensemble's, streamed or not, with the ensemble's token counts; 64 concurrent streams each get
their solo answer; bad requests get OpenAI-style errors with fitting status codes and the
gateway keeps serving; a client that goes away stops the generation; readiness, limits and
metrics."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from test_serve_server import data_uri, grpc_ask, iterations, png, samples_at

from qvl_trt.triton import contract as c

openai = pytest.importorskip("openai", reason="the acceptance tests use the openai package as "
                             "the client: pip install openai")

MODEL = c.ENSEMBLE  # the unnamed build's ensemble: its OpenAI model id
CHECKPOINT = "ckpt"  # the test checkpoint folder's name (conftest.tiny_ckpt)


def image_question(seed: int, question: str = "What is in the picture?",
                   size: tuple[int, int] = (64, 64)) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(png(seed, size))}},
        {"type": "text", "text": question}]}]


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def streamed(stream) -> tuple[str, list[str], list, object]:
    """(text, content deltas, finish reasons, usage) of a chat-completions stream."""
    deltas, finishes, counts = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            counts = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return "".join(deltas), deltas, finishes, counts


def gateway_metric(gateway, name: str, **labels: str) -> float:
    from qvl_trt.serve.progress import total

    return total(samples_at(f"{gateway.url}/metrics"), name, **labels)


def post(gateway, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    request = urllib.request.Request(f"{gateway.url}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- answers --------------------------------------------------------------------------------

def test_answers_and_usage_equal_the_ensembles(gateway, triton_server) -> None:
    messages = image_question(0)
    want = grpc_ask(triton_server, messages=messages, max_tokens=12)
    assert want.text == grpc_ask(triton_server, messages=messages, max_tokens=12,
                                 stream=False).text
    finish = "length" if want.completion_tokens == 12 else "stop"
    api = client(gateway)

    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                        temperature=0)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.id.startswith("chatcmpl-") and whole.created > 0
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].finish_reason == finish
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) \
        == (want.prompt_tokens, want.completion_tokens,
            want.prompt_tokens + want.completion_tokens)

    text, deltas, finishes, counts = streamed(api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert text == want.text and len(deltas) >= 3, deltas  # streamed in pieces
    assert finishes == [finish]
    assert (counts.prompt_tokens, counts.completion_tokens) == (want.prompt_tokens,
                                                               want.completion_tokens)
    # The checkpoint's sampling defaults when temperature is left out, as the ensemble does.
    seeded = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=5)
    assert seeded.choices[0].message.content == grpc_ask(
        triton_server, messages=messages, max_tokens=12, temperature=None, seed=5).text


def test_video_parts_give_the_ensembles_answer(gateway, triton_server) -> None:
    """A video_url part with an MP4 as a data URI, and vLLM's frame list
    (data:video/jpeg;base64,f1,f2,...), through the openai client: the ensemble's text and
    prompt tokens (visual tokens of both clips included)."""
    import base64
    import io

    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    from PIL import Image
    from video_clips import data_uri as video_uri
    from video_clips import frame_pixels, video_file

    def jpeg(i: int) -> str:
        buffer = io.BytesIO()
        Image.fromarray(frame_pixels(i, 64, 64, 5)).save(buffer, "JPEG")
        return base64.b64encode(buffer.getvalue()).decode()

    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_uri(video_file(20, 96, 64, seed=2),
                                                             "video/mp4")}},
        {"type": "video_url", "video_url": {
            "url": "data:video/jpeg;base64," + ",".join(jpeg(i) for i in range(4))}},
        {"type": "text", "text": "What changes between the clips?"}]}]
    want = grpc_ask(triton_server, messages=messages, max_tokens=10)
    answer = client(gateway).chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=10, temperature=0)
    assert answer.choices[0].message.content == want.text
    text_only = grpc_ask(triton_server, prompt="What changes between the clips?", max_tokens=1)
    assert answer.usage.prompt_tokens == want.prompt_tokens > text_only.prompt_tokens + 8


def test_the_stop_string_is_cut_and_the_finish_reason_follows(gateway, triton_server) -> None:
    messages = image_question(0)
    full = grpc_ask(triton_server, messages=messages, max_tokens=12)
    stop = full.chunks[1]  # one token's text
    cut = grpc_ask(triton_server, messages=messages, max_tokens=12, stop=[stop])
    # The ensemble leaves the stop string out, as OpenAI does: the gateway passes its text on.
    assert full.text.startswith(cut.text + stop) and len(cut.text) < len(full.text), \
        "no stop to test"
    api = client(gateway)
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                        temperature=0, stop=stop)
    assert whole.choices[0].message.content == cut.text
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == cut.completion_tokens
    text, _, finishes, _ = streamed(api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop, "zzz"],
        stream=True))
    assert (text, finishes) == (cut.text, ["stop"])


def test_as_many_concurrent_streams_as_the_build_admits_get_their_solo_answers(
        gateway) -> None:
    """The tiny profile's 8 batch slots and the default queue, 4 per slot: 40 at once."""
    from qvl_trt.testing.small_profile import LIMITS
    from qvl_trt.triton.options import QUEUE_PER_SLOT

    streams = LIMITS["max_batch_size"] * (1 + QUEUE_PER_SLOT)
    cases = [(image_question(20 + i, f"Question {i}: what do you see?",
                             (64 + 32 * (i % 3), 64)) if i % 2 else
              [{"role": "user", "content": f"Question {i}: tell me something."}], 5 + i)
             for i in range(8)]
    api = client(gateway)
    solo = [api.chat.completions.create(model=MODEL, messages=m, max_tokens=n, temperature=0)
            .choices[0].message.content for m, n in cases]
    assert len(set(solo)) > 1, "the cases should not all have the same answer"

    async def ask_all() -> list:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as aio:
            async def one(i: int) -> str:
                messages, n = cases[i % len(cases)]
                stream = await aio.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True)
                return "".join([chunk.choices[0].delta.content or ""
                                async for chunk in stream if chunk.choices])

            return await asyncio.gather(*(one(i) for i in range(streams)),
                                        return_exceptions=True)

    answers = asyncio.run(ask_all())
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors[:3]
    assert answers == [solo[i % len(cases)] for i in range(streams)]


# ---- bad requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("fields, error, status, param, words", [
    ({"model": "no-such-model"}, "NotFoundError", 404, "model", "does not exist"),
    ({"n": 2}, "BadRequestError", 400, "n", "n = 2 is not supported"),
    ({"tools": [{"type": "file_search"}]}, "BadRequestError", 400, "tools[0].type",
     "is not supported"),
    ({"max_tokens": 0}, "BadRequestError", 400, "max_tokens", "from 1 to"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(png(1)[:60])}},  # cut short
        {"type": "text", "text": "Hi"}]}]}, "BadRequestError", 400, None, "image 1:"),
    ({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
        {"type": "text", "text": "Hi"}]}]}, "BadRequestError", 400, None,
     "remote video URL on host 'example.com' refused"),  # forwarded; not on the allow-list
    ({"stop": [f"s{i}" for i in range(17)]}, "APIStatusError", 413, None, "max_stop_words"),
    # A client's words inside a refusal never decide its kind (only the start of the text,
    # which the server writes, does).
    *[({"messages": [{"role": role, "content": "Hi"}]}, "BadRequestError", 400, None,
       "has role") for role in ("internal error in x", "busy: x", "unavailable: x",
                                "over a deployment limit: x", "Stub process 'p' is not healthy.")],
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_request_gets_an_openai_error(gateway, fields, error, status, param, words,
                                            stream) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
               "max_tokens": 4, **fields}
    with pytest.raises(getattr(openai, error)) as caught:
        client(gateway).chat.completions.create(stream=stream, **request)
    assert caught.value.status_code == status
    body = caught.value.body
    assert words in body["message"], body
    assert body["param"] == param and body["type"] == "invalid_request_error"


def ensemble_refusal(triton_server, request: c.EnsembleRequest) -> str:
    """The ensemble's words for a request it refuses (over gRPC streaming, without Triton's
    ensemble prefix and the kind's marker)."""
    import queue

    import tritonclient.grpc as grpcclient

    errors: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(triton_server.grpc_url)
    triton.start_stream(callback=lambda result, error: errors.put(error))
    try:
        triton.async_stream_infer(MODEL, request.infer_inputs(grpcclient.InferInput),
                                  enable_empty_final_response=True)
        error = errors.get(timeout=120)
    finally:
        triton.stop_stream()
        triton.close()
    assert error is not None, "the ensemble took the request"
    kind, text = c.ErrorKind.split(error.message())
    assert kind is c.ErrorKind.REQUEST, error.message()
    return text


def test_a_rule_the_deployment_owns_is_refused_in_its_words_at_the_edge(gateway,
                                                                        triton_server) -> None:
    """The gateway refuses what the deployment would (a setting's range, min_tokens against
    max_tokens, how a guided answer ends) before sending it, naming OpenAI's param, in the
    words the ensemble itself answers the same request with."""
    guided = {"response_format": {"type": "json_object"}}
    cases = [  # (the OpenAI request's fields, the ensemble's, the param)
        ({"max_tokens": 0}, {"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3, "extra_body": {"min_tokens": 4}},
         {"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({**guided, "extra_body": {"ignore_eos": True}},
         {"guided_decoding_guide_type": "json", "ignore_eos": True}, "ignore_eos"),
        ({**guided, "extra_body": {"min_tokens": 2}},
         {"guided_decoding_guide_type": "json", "min_tokens": 2}, "min_tokens"),
    ]
    for fields, inputs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client(gateway).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                **{"max_tokens": 4, **fields})
        assert caught.value.body["param"] == param
        server = ensemble_refusal(triton_server, c.EnsembleRequest(
            messages=json.dumps([{"role": "user", "content": "Hi"}]),
            **{"max_tokens": 4, **inputs}))
        assert caught.value.body["message"] == server


def test_invalid_json_and_an_oversized_body_are_refused_and_service_goes_on(gateway) -> None:
    status, body = post(gateway, b'{"model": "ensemble", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    # Refused on its Content-Length, before a byte of it is read.
    conn = http.client.HTTPConnection("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]),
                                      timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(40 * 2**20))
    conn.endheaders()
    reply = conn.getresponse()
    body = json.loads(reply.read())
    conn.close()
    assert reply.status == 413 and body["error"]["code"] == "request_too_large"
    assert "limit of" in body["error"]["message"]
    # A body of millions of values is refused by a count of its separators, before parsing.
    numbers = b'{"model": "ensemble", "messages": [{"role": "user", "content": [' + \
        b",".join([b"1"] * 3_000_000) + b"]}]}"
    status, body = post(gateway, numbers)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "JSON separators" in body["error"]["message"]
    status, body = post(gateway, b"{}", "/v1/no-such-route")
    assert status == 404 and "error" in body
    answer = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Still there?"}], max_tokens=3)
    assert answer.usage.completion_tokens >= 1  # the gateway keeps serving


def test_models_list_the_builds_by_ensemble_name(gateway) -> None:
    api = client(gateway)
    assert [m.id for m in api.models.list()] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("tensorrt_llm")
    # vLLM's root: the checkpoint folder's name (the test checkpoint's is "ckpt"), which is
    # also taken as the model id, so a client can name the model by its tokenizer.
    listed = json.loads(urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=10).read())
    assert [(m["id"], m["root"]) for m in listed["data"]] == [(MODEL, CHECKPOINT)]
    assert api.models.retrieve(CHECKPOINT).id == MODEL
    answer = api.chat.completions.create(model=CHECKPOINT, messages=[
        {"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens >= 1


def test_a_fixed_output_length_as_aiperf_asks_for_it(gateway, triton_server) -> None:
    """vLLM's ignore_eos with min_tokens = max_tokens = N (what NVIDIA AIPerf sends): exactly N
    completion tokens, streamed or not; continuous_usage_stats puts the usage so far in every
    chunk."""
    api = client(gateway)
    messages = [{"role": "user", "content": "Count."}]
    fixed = {"ignore_eos": True, "min_tokens": 24}
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                         temperature=0, extra_body=fixed)
    assert answer.usage.completion_tokens == 24 and answer.choices[0].finish_reason == "length"
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body=fixed, stream_options={"include_usage": True,
                                          "continuous_usage_stats": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts[0] == 0 and counts[-1] == 24 and counts == sorted(counts)
    assert all(chunk.usage.prompt_tokens == answer.usage.prompt_tokens for chunk in chunks)
    assert "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices) == \
        answer.choices[0].message.content
    # The ensemble takes the same inputs and answers the same tokens.
    ensemble = grpc_ask(triton_server, messages=messages, max_tokens=24, temperature=0,
                        min_tokens=24, ignore_eos=True)
    assert ensemble.completion_tokens == 24 and ensemble.text == answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=messages, extra_body={
            "min_tokens": 10**6})
    assert "min_tokens = 1000000 is above max_tokens" in caught.value.body["message"]


def photo_question(**image_url) -> list[dict]:
    """One 1920x1080 photo (a smooth JPEG, small to send) and a question; `image_url`: its
    fields beside the url (detail)."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:1080, 0:1920]
    pixels = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=80)
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": url, **image_url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def test_usage_reports_the_visual_tokens_of_each_budget(gateway) -> None:
    """Through the openai client: the same 1920x1080 photo at detail low and high, at an
    explicit max_pixels (on the part, and request-wide as vLLM's mm_processor_kwargs), each
    reported in usage.prompt_tokens_details; the test profile's maximum (65536 pixels) is
    below low's cap, so low and high both cost its 60 tokens. A budget above the
    deployment's limit, or an unknown detail, is a 400 naming it."""
    api = client(gateway)

    def usage(messages, stream=False, **body):
        kwargs = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0,
                  "extra_body": body or None}
        if not stream:
            return api.chat.completions.create(**kwargs).usage
        return streamed(api.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))[3]

    def visual(counts) -> tuple[int, int]:
        details = counts.prompt_tokens_details
        return details.image_tokens, details.video_tokens

    low, high = usage(photo_question(detail="low")), usage(photo_question(detail="high"))
    assert visual(low) == visual(high) == (60, 0)
    assert visual(usage(photo_question(detail="low"), stream=True)) == (60, 0)
    part = photo_question()
    part[0]["content"][0]["max_pixels"] = 16384  # 96x160: 15 tokens
    explicit = usage(part)
    assert visual(explicit) == (15, 0)
    assert low.prompt_tokens - explicit.prompt_tokens == 60 - 15
    assert visual(usage(photo_question(), mm_processor_kwargs={"max_pixels": 16384})) == (15, 0)
    text = usage([{"role": "user", "content": "Hi"}])
    assert visual(text) == (0, 0)

    part[0]["content"][0]["max_pixels"] = 65537
    with pytest.raises(openai.BadRequestError) as caught:
        usage(part)
    assert "max_pixels = 65537 is above the deployment's maximum of 65536 pixels per image " \
        "(limits.vision_max_pixels)" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        usage(photo_question(detail="ultra"))
    assert caught.value.body["param"] == "messages[0].content[0].image_url.detail"
    with pytest.raises(openai.BadRequestError) as caught:
        usage(photo_question(), mm_processor_kwargs={"size": 3})
    assert caught.value.body["param"] == "mm_processor_kwargs.size"


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_is_a_400_naming_its_field(gateway, stream) -> None:
    """JSON can spell a lone surrogate, which the ensemble's UTF-8 inputs cannot carry: refused
    by name before any call (it used to fail inside the gRPC call and cancel it)."""
    def ask(**fields) -> tuple[int, dict]:
        request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 2, "stream": stream, **fields}
        return post(gateway, json.dumps(request).encode())  # "\ud800" spelled as an escape

    status, body = ask(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look \ud800"}]}])
    assert status == 400 and body["error"]["param"] == "messages[0].content[0].text"
    assert "holds a lone surrogate (U+D800" in body["error"]["message"]
    status, body = ask(stop=["ok", "\udfff"])
    assert (status, body["error"]["param"]) == (400, "stop")
    assert "stop[1] holds a lone surrogate" in body["error"]["message"]
    status, body = ask(temperature=1e308)
    assert status == 400 and "beyond float32" in body["error"]["message"]
    # Far below float32's normal range: greedy, as TensorRT-LLM computes it (it was a 500).
    for tiny in (1e-40, 1e-45):
        status, body = ask(temperature=tiny, stream=False, max_tokens=6)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == ask(
            temperature=0, stream=False, max_tokens=6)[1]["choices"][0]["message"]["content"]


# ---- cancellation ---------------------------------------------------------------------------

def settled_iterations(server, settle_s: float = 1.0, wait_s: float = 120) -> float:
    """tensorrt_llm's iteration counter once it has not moved for `settle_s` (nothing is
    generating)."""
    deadline = time.monotonic() + wait_s
    last = iterations(server)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        if (now := iterations(server)) == last:
            return now
        last = now
    raise AssertionError(f"tensorrt_llm was still generating after {wait_s} s")


def test_a_client_that_goes_away_stops_the_generation(gateway, triton_server) -> None:
    max_tokens = 400
    before = settled_iterations(triton_server)
    closed_before = gateway_metric(gateway, "qvl_gateway_requests_total", status="499")
    received = 0
    with client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=max_tokens, temperature=0, stream=True) as stream:
        for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break  # leaving the block closes the connection
    # The reference tensorrt_llm stops stepping (one iteration a token while it is the only
    # request): it would go on to max_tokens, about 70 a second here, had the cancel not
    # reached it (e.g. through the ensemble, whose scheduler does not pass it on).
    made = settled_iterations(triton_server) - before
    print(f"the client left after {received} pieces; tensorrt_llm made {made:.0f} tokens for "
          f"it (max_tokens {max_tokens})")
    assert received <= made < max_tokens // 4, "the generation was not stopped"
    follow = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Still there?"}], max_tokens=4,
        temperature=0)
    assert follow.usage.completion_tokens >= 1  # the server keeps serving
    assert gateway_metric(gateway, "qvl_gateway_requests_total", status="499") == \
        closed_before + 1


# ---- the answer cache -----------------------------------------------------------------------

def cache_metrics(gateway) -> dict[str, float]:
    got = {r: gateway_metric(gateway, "qvl_gateway_answer_cache_lookups_total", model=MODEL,
                             result=r) for r in ("hit", "miss", "bypass")}
    got["entries"] = gateway_metric(gateway, "qvl_gateway_answer_cache_entries")
    return got


def late_stop(api, messages, after: int, max_tokens: int) -> tuple[int, str]:
    """(a seed, a stop string) where the seeded answer has a piece of text that first appears
    after `after` pieces: with it as the stop string the answer ends there, by itself ("stop").
    Seeded sampling, not greedy: the random tiny model's greedy answers soon repeat a token."""
    for seed in range(1, 6):
        deltas = streamed(api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1, seed=seed,
            stream=True, extra_body={"answer_cache": False}))[1]
        text = "".join(deltas)
        for i in range(len(deltas) - 2, after, -1):
            for n in (1, 2, 3):
                if (s := "".join(deltas[i:i + n])).strip() and \
                        text.find(s) == len("".join(deltas[:i])):
                    return seed, s
    raise AssertionError("no seed gives a late stop string")


def test_a_repeated_deterministic_answer_comes_from_the_cache(gateway) -> None:
    """Through the real openai client: a seeded answer that ended by itself (at a stop string:
    the tiny model rarely ends on its own) is answered again from the cache, with the same
    choices and usage, streamed in the same content deltas; no-store, the body's opt-out, a
    sampled request without a seed, a cancelled stream and a greedy answer cut at max_tokens
    are not; the counters move."""
    api = client(gateway)
    messages = image_question(31, "What does the answer cache hold?")
    # A stop late enough that the cancelled stream below is left with tokens to generate.
    seed, stop = late_stop(api, messages, after=16, max_tokens=48)
    print(f"seed {seed}, stop string {stop!r}")
    before = cache_metrics(gateway)

    def ask(stream: bool = False, headers: dict | None = None, **fields):
        fields = {"max_tokens": 48, "temperature": 1, "seed": seed, **fields}
        raw = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=stream, extra_headers=headers, **fields)
        return raw.headers["x-qvl-cache"], raw.parse()

    # A stream the client leaves early is not kept.
    with api.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                     temperature=1, seed=seed, stop=stop, stream=True) as cut:
        next(c for c in cut if c.choices and c.choices[0].delta.content)
    usage_opts = {"include_usage": True}
    status, stream = ask(stream=True, stop=stop, stream_options=usage_opts)
    assert status == "miss"
    miss = streamed(stream)
    assert miss[2] == ["stop"]
    status, stream = ask(stream=True, stop=stop, stream_options=usage_opts)
    assert status == "hit"
    hit = streamed(stream)
    assert hit[1] == miss[1] and len(hit[1]) > 5  # the same content deltas, in the same chunks
    assert hit[2] == ["stop"] and hit[3] == miss[3]  # finish and usage as the original's

    # The whole answer shares the stream's entry; two hits in a row are the same answer.
    status, first = ask(stop=stop)
    status2, again = ask(stop=stop)
    assert status == status2 == "hit"
    assert first.choices[0].message.content == miss[0]
    assert [c.model_dump() for c in first.choices] == [c.model_dump() for c in again.choices]
    assert first.usage == again.usage and first.usage.completion_tokens == miss[3] \
        .completion_tokens
    assert first.id != again.id  # a new response each time

    assert ask(stop=stop, headers={"Cache-Control": "no-store"})[0] == "bypass"
    assert ask(stop=stop, extra_body={"answer_cache": False})[0] == "bypass"
    assert ask(stop=stop, seed=None)[0] == "bypass"  # sampled, no seed
    # Greedy, so looked up, but cut at max_tokens: asked twice, generated twice.
    assert [ask(max_tokens=4, temperature=0, seed=None)[0] for _ in range(2)] == ["miss", "miss"]
    with pytest.raises(openai.NotFoundError) as caught:
        api.chat.completions.create(model="nope", messages=messages, temperature=0)
    assert caught.value.response.headers["x-qvl-cache"] == "bypass"

    after = cache_metrics(gateway)
    # bypass: answer_cache false, no-store, no seed; miss: the cancelled stream, the
    # stream, max_tokens 4 twice; hit: the stream and two whole answers.
    assert {k: after[k] - before[k] for k in ("hit", "miss", "bypass")} == \
        {"hit": 3, "miss": 4, "bypass": 3}
    assert after["entries"] >= before["entries"] + 1
    assert gateway_metric(gateway, "qvl_gateway_answer_cache_bytes") > 0


# ---- readiness, limits, metrics -------------------------------------------------------------

def test_metrics_count_requests_tokens_and_latency(gateway) -> None:
    watched = (("qvl_gateway_requests_total", {"model": MODEL, "stream": "true",
                                               "status": "200"}),
               ("qvl_gateway_requests_total", {"status": "404"}),
               ("qvl_gateway_completion_tokens_total", {"model": MODEL}),
               ("qvl_gateway_time_to_first_token_seconds_count", {"model": MODEL}),
               ("qvl_gateway_request_duration_seconds_count", {"model": MODEL, "stream": "true"}))
    before = [gateway_metric(gateway, name, **labels) for name, labels in watched]
    _, _, _, counts = streamed(client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=5,
        stream=True, stream_options={"include_usage": True}))
    with pytest.raises(openai.NotFoundError):
        client(gateway).chat.completions.create(model="nope", messages=[
            {"role": "user", "content": "Hi"}])
    after = [gateway_metric(gateway, name, **labels) for name, labels in watched]
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert grown == [1, 1, counts.completion_tokens, 1, 1]
    assert gateway_metric(gateway, "qvl_gateway_requests_in_flight") == 0


def test_readiness_fails_for_a_model_that_is_not_ready(gateway, triton_server) -> None:
    """The gateway's check against the real server, with one build whose models the server
    does not have."""
    from qvl_trt.gateway.upstream import Upstream

    assert json.loads(urllib.request.urlopen(f"{gateway.url}/ready").read()) == \
        {"ready": True, "reason": "ready"}

    async def check() -> list[tuple[bool, str]]:
        upstream = Upstream(triton_server.grpc_url)
        try:
            served = await upstream.discover()
            build = served[MODEL].builds[0]
            ghost = dataclasses.replace(build, name="ghost",
                                        models=c.ModelNames.for_build("ghost"))
            # A model of two builds whose second is not there: not ready either.
            pair = dataclasses.replace(served[MODEL], builds=(build, ghost))
            return [await upstream.models_ready(served),
                    await upstream.models_ready({MODEL: pair}),
                    await upstream.models_ready({})]
        finally:
            await upstream.close()

    ok, ghost, none = asyncio.run(check())
    assert ok == (True, "ready")
    assert ghost == (False, "model ghost is not ready")
    assert none[0] is False and "serves no build" in none[1]


def test_without_triton_readiness_fails_and_limits_answer_429_and_413(tmp_path) -> None:
    """A gateway whose Triton is not there (a free port): it runs and says why it is not
    ready; its concurrency and body limits answer before anything reaches Triton."""
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    ports = free_ports()
    opts = GatewayOptions(f"127.0.0.1:{ports.grpc}", port=ports.http, max_concurrency=1,
                          max_body_bytes=4096)
    with GatewayProcess(opts, log_file=tmp_path / "gateway.log") as gateway:
        assert urllib.request.urlopen(f"{gateway.url}/live").status == 200
        ready, reason = gateway.readiness()
        assert not ready and f"127.0.0.1:{ports.grpc}" in reason
        with pytest.raises(openai.InternalServerError) as caught:
            client(gateway).chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "Hi"}])
        assert caught.value.status_code == 503 and "not ready" in caught.value.body["message"]
        assert [m.id for m in client(gateway).models.list()] == []
        status, body = post(gateway, b" " * 5000)
        assert status == 413 and "4096" in body["error"]["message"]
        # One request in flight (its body still coming), so the next one is over the limit.
        slow = socket.create_connection(("127.0.0.1", ports.http))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        with pytest.raises(openai.RateLimitError) as caught:
            client(gateway).chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "Hi"}])
        assert caught.value.response.headers["retry-after"] == "1"
        slow.close()


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP exchange: (status, headers, body) of the answer to `raw`."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(raw)
        reply = http.client.HTTPResponse(conn)
        reply.begin()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()


def test_every_v1_refusal_is_openai_shaped_whatever_layer_refuses(tmp_path) -> None:
    """aiohttp's own refusals (its HTTP parser's, before any route or middleware) and JSON
    nested past the parser's bound answer in OpenAI's error shape, not aiohttp's plain text;
    the gateway goes on serving. No Triton is needed to refuse them."""
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    ports = free_ports()
    opts = GatewayOptions(f"127.0.0.1:{ports.grpc}", port=ports.http, max_body_bytes=2**20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    cases = {
        "a 100 KB header": head + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        "Content-Length with chunked": head + b"Content-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "a malformed request line": b"POST /v1/chat/completions HTTP/9\x00\r\n\r\n",
        "a bad header name": head + b"Bad Header: 1\r\n\r\n",
    }
    deep = b"[" * 100_000 + b"]" * 100_000
    with GatewayProcess(opts, log_file=tmp_path / "gateway.log") as gateway:
        for case, raw in cases.items():
            status, headers, body = exchange(ports.http, raw)
            assert 400 <= status < 500, case
            assert headers["content-type"].startswith("application/json"), (case, body)
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["message"], case
        status, headers, body = exchange(ports.http, head + b"Content-Type: application/json"
                                         b"\r\nContent-Length: %d\r\n\r\n" % len(deep) + deep)
        assert status == 400 and "nests its JSON too deeply" in json.loads(body)["error"][
            "message"]
        # Through the openai package too (it cannot send a lone surrogate: its own encoder
        # refuses one), and the gateway still answers.
        with pytest.raises(openai.BadRequestError) as caught:
            client(gateway).chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "Hi"}], temperature=1e308)
        assert caught.value.body["param"] == "temperature"
        assert "beyond float32" in caught.value.body["message"]
        assert urllib.request.urlopen(f"{gateway.url}/live").status == 200


def test_an_uncaught_handler_error_is_a_500_in_openai_shape_without_its_detail() -> None:
    """A handler's exception that no middleware answers reaches aiohttp's handle_error: the
    gateway's runner answers it in OpenAI's shape, naming the type only (the text stays in
    the log)."""
    from aiohttp import web

    from qvl_trt.gateway.app import _app_runner
    from qvl_trt.serve.server import free_ports

    async def boom(request):
        raise RuntimeError("a secret detail")

    async def main() -> tuple[int, dict[str, str], bytes]:
        app = web.Application()
        app.add_routes([web.get("/v1/boom", boom)])
        runner = _app_runner(web)(app, access_log=None)
        await runner.setup()
        port = free_ports().http
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return await asyncio.to_thread(exchange, port,
                                           b"GET /v1/boom HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            await runner.cleanup()

    status, headers, body = asyncio.run(main())
    assert status == 500 and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and "(RuntimeError)" in error["message"]
    assert "secret" not in error["message"]


def test_with_an_api_key_v1_asks_for_it_and_the_rest_stays_open(gateway, triton_server,
                                                                  tmp_path) -> None:
    """QVL_TRT_API_KEY's gateway: /v1/ without the key or with another one answers 401
    (invalid_api_key, the openai package's AuthenticationError), with it the usual answer; the
    page, /ready and /live need no key; the key is not on the child's command line. `qvl-trt
    infer --endpoint openai` sends $QVL_TRT_API_KEY and gets the same answer."""
    import os
    from pathlib import Path

    from cli_harness import run_cli

    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import free_ports

    key = "s3cret-key"
    opts = GatewayOptions(triton_server.grpc_url, port=free_ports().http, api_key=key)
    messages = [{"role": "user", "content": "Count."}]
    with GatewayProcess(opts, log_file=tmp_path / "gateway.log") as keyed:
        keyed.wait_ready()
        assert key.encode() not in Path(f"/proc/{keyed.process.pid}/cmdline").read_bytes()
        assert urllib.request.urlopen(f"{keyed.url}/").status == 200
        assert urllib.request.urlopen(f"{keyed.url}/live").status == 200
        status, body = post(keyed, json.dumps({"model": MODEL, "messages": messages}).encode())
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
        wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in right.models.list()] == [MODEL]
        answer = right.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                               temperature=0)
        assert answer.choices[0].message.content == client(gateway).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0).choices[0] \
            .message.content

        def infer(key_env: str | None, *args: str):
            env = {k: v for k, v in os.environ.items() if k != "QVL_TRT_API_KEY"}
            return run_cli("infer", "--url", keyed.url, "--endpoint", "openai", "--prompt",
                           "Count.", "--max-tokens", "4", "--json", *args,
                           env=env | ({"QVL_TRT_API_KEY": key_env} if key_env else {}))

        done = infer(key)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["text"] == answer.choices[0].message.content
        refused = infer(None)
        assert refused.returncode == 1 and "API key" in refused.stderr, refused.stderr
        unsupported = infer(key, "--regex", "[0-9]+")
        assert unsupported.returncode == 1
        assert "leave out --endpoint openai" in unsupported.stderr, unsupported.stderr


@pytest.mark.parametrize("key", ["", " padded", "two words", "tab\tinside"])
def test_an_unusable_api_key_is_refused_in_one_line(key: str) -> None:
    from qvl_trt.errors import ConfigError
    from qvl_trt.gateway.options import GatewayOptions

    with pytest.raises(ConfigError, match="QVL_TRT_API_KEY"):
        GatewayOptions("127.0.0.1:8001", api_key=key)


def test_the_gateway_loads_neither_mm_nor_the_runtime_nor_numba_nor_pil() -> None:
    """The gateway reads the wire's facts from the contract only: importing it loads none of
    the server side (numba alone took most of its 0.9 s)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, qvl_trt.gateway.app; print(' '.join(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('numba', 'PIL') or m.startswith(('qvl_trt.mm', "
            "'qvl_trt.triton.runtime')))))")
    root = Path(__file__).resolve().parents[1]
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=root).stdout.split()
    assert loaded == []


def test_every_series_the_dashboard_and_alerts_use_is_published(gateway, triton_server) -> None:
    """After a streamed image question, Triton's and the gateway's metrics pages carry every
    series deploy --monitoring's dashboard and alerts query (serve's own: in
    test_serve_supervisor.py; the DCGM exporter's run outside the pod)."""
    from test_deploy_monitoring import missing_series, report_missing

    from qvl_trt.deploy.monitoring import Source

    streamed(client(gateway).chat.completions.create(
        model=MODEL, messages=image_question(7), max_tokens=6, stream=True))
    samples = {**samples_at(triton_server.metrics_url), **samples_at(f"{gateway.url}/metrics")}
    report_missing(missing_series(samples, {Source.TRITON, Source.GATEWAY}))


def test_tenants_keep_their_quotas_and_caches_apart_and_keys_rotate_without_a_restart(
        triton_server, tmp_path) -> None:
    """A keys file of three tenants: alpha (2 requests a minute), beta, and gamma, which
    shares beta's cache scope by configuration. The same fresh image question from each:
    beta's second is a vision-cache hit and reuses KV blocks, alpha's is neither, gamma's is
    both; every answer is the same. A repeated answer that ended by itself comes from the
    answer cache for beta and gamma, not for delta (a fourth tenant). alpha's third request is a 429 naming its quota while
    beta goes on; the metrics carry the tenant; a new key for beta, written over the file
    under the running gateway, works once the gateway reports the file's second generation,
    and the old one no longer does."""
    from qvl_trt.gateway import metrics as gm
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.gateway.tenants import KeyRing, Quotas, add_key, key_digest, read_keys, write_keys
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.progress import total
    from qvl_trt.serve.server import free_ports
    from qvl_trt.triton import tensorrtllm_backend as tb

    keys = tmp_path / "keys.json"
    alpha, _ = add_key(keys, "alpha", Quotas(requests_per_minute=2))
    beta, _ = add_key(keys, "beta")
    gamma, _ = add_key(keys, "gamma", cache_scope="beta")
    delta, _ = add_key(keys, "delta")
    question = image_question(4242, "Describe the picture in detail, please. " * 4, (128, 128))

    def ask(gateway, key: str) -> str:
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
        return api.chat.completions.create(model=MODEL, messages=question, max_tokens=3,
                                           temperature=0).choices[0].message.content

    def caches() -> tuple[float, float, float]:
        samples = samples_at(triton_server.metrics_url)
        return (total(samples, c.VISION_CACHE_HITS), total(samples, c.VISION_CACHE_MISSES),
                total(samples, tb.KV_CACHE_METRICS.family,
                      **{tb.KV_CACHE_METRICS.category: "reused"}))

    opts = GatewayOptions(triton_server.grpc_url, port=free_ports().http, keys_file=keys)
    with GatewayProcess(opts, log_file=tmp_path / "gateway.log") as tenants:
        tenants.wait_ready()
        seen, answers = [caches()], []
        for key in (beta, beta, alpha, gamma):
            answers.append(ask(tenants, key))
            seen.append(caches())
        hits, misses, reused = zip(*(tuple(b - a for a, b in zip(x, y, strict=True))
                                     for x, y in zip(seen, seen[1:], strict=False)), strict=True)
        print(f"vision cache hits {hits}, misses {misses}, KV blocks reused {reused}")
        assert (hits, misses) == ((0, 1, 0, 1), (1, 0, 1, 0))
        assert reused[0] == reused[2] == 0 and reused[1] > 0 and reused[3] > 0
        assert len(set(answers)) == 1, answers

        def api_of(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{tenants.url}/v1", api_key=key, max_retries=0)

        text_question = [{"role": "user", "content": "Name a colour."}]
        seed, stop = late_stop(api_of(delta), text_question, after=2, max_tokens=24)

        def cached(key: str) -> tuple[str, str, str]:
            """(x-qvl-cache, finish reason, answer) of a seeded question that ends by itself."""
            raw = api_of(key).chat.completions.with_raw_response.create(
                model=MODEL, messages=text_question, max_tokens=24, temperature=1, seed=seed,
                stop=stop)
            choice = raw.parse().choices[0]
            return raw.headers["x-qvl-cache"], choice.finish_reason, choice.message.content

        stopped = [cached(key) for key in (beta, beta, gamma, delta)]
        assert [s[:2] for s in stopped] == [("miss", "stop"), ("hit", "stop"), ("hit", "stop"),
                                            ("miss", "stop")], stopped
        assert len({s[2] for s in stopped}) == 1

        ask(tenants, alpha)
        with pytest.raises(openai.RateLimitError) as caught:
            ask(tenants, alpha)
        assert caught.value.body["param"] == "requests_per_minute"
        assert "'alpha' is at its requests_per_minute of 2" in caught.value.body["message"]
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert ask(tenants, beta) == answers[0]  # the other tenant is not refused

        def metric(name: str, **labels: str) -> float:
            return gateway_metric(tenants, name, **labels)

        assert metric(gm.REQUESTS, tenant="alpha", status="429") == 1
        assert metric(gm.REQUESTS, tenant="alpha", status="200") == 2
        assert metric(gm.REQUESTS, tenant="beta", status="200") == 5
        assert metric(gm.QUOTA_REFUSALS, tenant="alpha", limit="requests_per_minute") == 1
        assert metric(gm.COMPLETION_TOKENS, tenant="gamma") >= 1
        assert metric(gm.KEYS_GENERATION) == 1

        ring = read_keys(keys)
        new_beta = "qvl-the-new-key-of-beta"
        digest = key_digest(new_beta)
        write_keys(keys, KeyRing(ring.tenants, tuple(
            dataclasses.replace(k, id=digest[:12], sha256=digest) if k.tenant == "beta" else k
            for k in ring.keys)))
        deadline = time.monotonic() + 60
        while metric(gm.KEYS_GENERATION) < 2:
            assert time.monotonic() < deadline, "the gateway did not take the new keys file"
            time.sleep(0.2)
        assert ask(tenants, new_beta) == answers[0]
        with pytest.raises(openai.AuthenticationError):
            ask(tenants, beta)
        assert tenants.process.poll() is None  # the same process: no restart
