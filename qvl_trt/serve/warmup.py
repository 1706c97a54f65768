"""serve's warm-up: before a (re)started server reports ready, one small real request goes
through each ensemble, a question about a tiny image answered with WARM_TOKENS tokens, so
that what a model does only on its first request (the tokenizer's and chat template's first
use, the pixel kernels' first call, the vision engine's first inference: TensorRT-RTX
compiles for the card then, the LLM's first steps) is done before the first client's request,
not during it. The health probe cannot do it: it is text-only and one token
(contract.HEALTH_PROBE).

Triton counts the warm request as it counts the probes, in its per-model counters
(nv_inference_request_success and the rest, one per ensemble and start); the gateway's
metrics never see it (serve sends it to Triton's HTTP endpoint, not through the gateway).
Standard library only: serve starts without numpy or PIL imported.
"""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request
import zlib

from ..errors import ServerError
from ..triton import contract as c

WARM_PROMPT = "Describe this image."
WARM_TOKENS = 2  # past the first token: the decoding step after prefill runs too
# Side of the warm image, in pixels; preprocessing resizes it to at least its minimum.
WARM_IMAGE_SIDE = 64


def png(width: int, height: int, rgb: tuple[int, int, int] = (128, 96, 64)) -> bytes:
    """A PNG of one colour, written with zlib alone."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    row = b"\x00" + bytes(rgb) * width  # filter type 0, then the pixels
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b""))


def warm_body() -> dict:
    """The warm request, as Triton's HTTP generate endpoint takes it (an image as a data URI:
    JSON carries no raw bytes)."""
    image = base64.b64encode(png(WARM_IMAGE_SIDE, WARM_IMAGE_SIDE)).decode()
    return {c.TEXT_INPUT: WARM_PROMPT, c.IMAGE_BYTES: [f"data:image/png;base64,{image}"],
            c.MAX_TOKENS: WARM_TOKENS, c.TEMPERATURE: 0.0, c.STREAM: False}


def warm_up(http_url: str, ensemble: str, timeout_s: float) -> None:
    """Send the warm request through `ensemble` at the server `http_url` (host:port) and wait
    for its answer; a ServerError says why it failed."""
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{ensemble}/generate", data=json.dumps(warm_body()).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:300]
        raise ServerError(f"the warm-up request through {ensemble} failed: HTTP {exc.code} "
                          f"{text}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerError(f"the warm-up request through {ensemble} failed: {exc}") from None
    if c.TEXT_OUTPUT not in answer:
        raise ServerError(f"the warm-up request through {ensemble} got no {c.TEXT_OUTPUT}: "
                          f"{str(answer)[:300]}")
