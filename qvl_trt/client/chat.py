"""A client of the OpenAI-compatible endpoint (POST /v1/chat/completions, streamed), giving
the same `Response` items as the ensemble's client so that bench measures every path alike:
each content chunk is a response carrying output (its arrival is the first token's), and the
final usage chunk (`stream_options.include_usage`) carries the token counts the deployment
reported.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

from ..errors import InputError, RequestError
from ..triton import contract as c
from .generate import (
    Endpoint,
    GenerateRequest,
    Response,
    _one_line,
    check_max_tokens,
    fixed_length_fields,
    parse_url,
    post_events,
    user_content,
)

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"


def openai_endpoint(url: str) -> Endpoint:
    """The gateway's address: `http://HOST:PORT` only (the OpenAI API is HTTP)."""
    endpoint = parse_url(url)
    if endpoint.protocol != "http":
        raise InputError(f"--url {url!r}: the OpenAI endpoint is HTTP; give the gateway's "
                         "http://HOST:PORT")
    return endpoint


def chat_body(req: GenerateRequest, model: str) -> dict:
    """The chat completion request of a question: one user message of the prompt, then the
    images (at the request's budget) and videos (at its fps) as data: URIs; streamed, with the
    usage in the last chunk."""
    check_max_tokens(req)
    body = {"model": model, "messages": [{"role": "user", "content": user_content(req)}],
            "max_tokens": req.max_tokens, "temperature": req.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    optional = {"top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
                "stop": list(req.stop) or None, "response_format": _response_format(req)}
    return body | {k: v for k, v in optional.items() if v is not None} | \
        fixed_length_fields(req)


def _response_format(req: GenerateRequest) -> dict | None:
    """A JSON schema guide as OpenAI's response_format; the API has no other guide's form."""
    from ..llm.guided import GuideType

    if req.guide_type is None:
        return None
    if req.guide_type != GuideType.JSON_SCHEMA.value:
        raise InputError("through the OpenAI endpoint a guide is a --json-schema (OpenAI's "
                         "response_format); --regex, --grammar, --json-object and --compact go "
                         "to the ensemble: leave out --endpoint openai")
    return {"type": "json_schema", "json_schema": {"name": "answer",
                                                   "schema": json.loads(req.guide)}}


class ChatClient:
    """One connection to the gateway; one request at a time (one client per thread)."""

    def __init__(self, url: str, *, model: str, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.endpoint = openai_endpoint(url)
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc) -> None:
        pass  # a connection per request: nothing is held between them

    def _get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port,
                                          timeout=self.timeout_s)
        try:
            conn.request("GET", path, headers=self.headers)
            reply = conn.getresponse()
            body = reply.read()
        except OSError as exc:
            raise RequestError(f"{self.endpoint.address}: {exc}") from None
        finally:
            conn.close()
        if reply.status != 200:
            raise RequestError(_error(reply.status, body))
        return json.loads(body)

    def served_model(self, wanted: str = c.ENSEMBLE) -> str:
        """The model id to ask: `wanted` when the gateway serves it, else (for the default
        name) the one model it serves; an InputError names the ids when that is not clear."""
        ids = [card["id"] for card in self._get(MODELS_PATH)["data"]]
        if wanted in ids:
            return wanted
        if len(ids) == 1 and wanted == c.ENSEMBLE:
            return ids[0]
        raise InputError(f"--served-model {wanted}: the gateway at {self.endpoint.address} "
                         f"serves {', '.join(ids) or 'no model'}; pass one of them")

    def stream(self, req: GenerateRequest, *, sent_at: list | None = None) \
            -> Iterator[Response]:
        """Yield a response per content chunk and one for the usage chunk, as they arrive;
        `sent_at`, if given, receives the perf_counter time the request went out."""
        events = post_events(self.endpoint, CHAT_PATH, json.dumps(chat_body(req, self.model)),
                             self.headers, timeout_s=self.timeout_s, sent_at=sent_at,
                             error_line=_error)
        finish = ""
        for received, data in events:
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:  # refused after the stream began: OpenAI's error shape
                error = chunk["error"]
                raise RequestError(_one_line(error.get("message", error)
                                             if isinstance(error, dict) else error))
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    yield Response(received, text, 0, 0)
            if chunk.get("usage"):
                usage = chunk["usage"]
                details = usage.get("prompt_tokens_details") or {}
                media = tuple(details.get(name) for name in c.MEDIA_TOKEN_OUTPUTS)
                yield Response(received, "", usage["prompt_tokens"],
                               usage["completion_tokens"], finish,
                               None if None in media else media)


def _error(status: int, body: bytes) -> str:
    """An answer other than 200 as one line: OpenAI's error message when it has one."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return f"HTTP {status}: {_one_line(message)}"

