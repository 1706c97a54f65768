"""The serving half of `make demo`: `qvl-trt serve REPO --openai-port P` on free ports, one
question about a generated picture with `qvl-trt infer --stream` (the answer as it arrives,
then the timings), the chat page fetched once and the same question asked through the OpenAI
endpoint by the snippet it prints (the `openai` package), then Ctrl-C to the server, which
stops it and its gateway cleanly. It ends by printing how to keep a server running: the
command, the chat page's address and the snippet for that address.

Usage: python scripts/demo_serve.py REPO [--work-dir DIR] [--prompt TEXT] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from PIL import Image, ImageDraw

from qvl_trt.serve.server import free_ports

QVL_TRT = str(Path(sys.executable).with_name("qvl-trt"))
# The port the closing lines suggest for a server that keeps running.
OPENAI_PORT = 9000
SNIPPET = """\
import base64
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")
image = base64.b64encode(open({image}, "rb").read()).decode()
stream = client.chat.completions.create(
    model="ensemble",
    messages=[{{"role": "user", "content": [
        {{"type": "image_url", "image_url": {{"url": "data:image/png;base64," + image}}}},
        {{"type": "text", "text": {prompt}}}]}}],
    max_tokens={max_tokens}, temperature=0, stream=True)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
"""


def demo_image(path: Path) -> Path:
    """A 320x240 picture: sky, sun, a house."""
    image = Image.new("RGB", (320, 240), (135, 190, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 170, 320, 240), fill=(70, 150, 60))
    draw.ellipse((240, 20, 290, 70), fill=(250, 210, 60))
    draw.rectangle((60, 110, 160, 190), fill=(200, 80, 60))
    draw.polygon([(50, 110), (110, 60), (170, 110)], fill=(120, 60, 40))
    image.save(path)
    return path


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"qvl-trt serve exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")


def fetch_page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        page = reply.read().decode()
    if "<title>qvl-trt chat</title>" not in page:
        raise SystemExit(f"{url} did not answer with the chat page")
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", type=Path)
    parser.add_argument("--work-dir", type=Path, default=Path("."),
                        help="Where the picture and the server log go.")
    parser.add_argument("--prompt", default="What is in this picture?")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    image = demo_image(args.work_dir / "demo.png")
    ports, openai_port = free_ports(), free_ports().http
    log = args.work_dir / "server.log"
    print(f"serving {args.repo} (log: {log})", flush=True)
    server = subprocess.Popen(
        [QVL_TRT, "serve", str(args.repo), "--host", "127.0.0.1", "--http-port",
         str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
         "--log-file", str(log), "--openai-port", str(openai_port)])
    snippet = functools.partial(SNIPPET.format, image=json.dumps(str(image)),
                                prompt=json.dumps(args.prompt), max_tokens=args.max_tokens)
    try:
        wait_ready(f"http://127.0.0.1:{openai_port}/ready", server, 300)
        print(f"asking about {image}: {args.prompt!r}", flush=True)
        asked = subprocess.run(
            [QVL_TRT, "infer", "--url", f"grpc://127.0.0.1:{ports.grpc}", "--image", str(image),
             "--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--stream"])
        page = f"http://127.0.0.1:{openai_port}/"
        fetch_page(page)
        print(f"\nchat page (while this demo serves): {page}\nthe same question through the "
              f"OpenAI endpoint, with the openai package:\n\n{snippet(port=openai_port)}",
              flush=True)
        through_openai = subprocess.run([sys.executable, "-c", snippet(port=openai_port)])
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C does
        server.wait(timeout=120)
    print(f"server stopped (exit code {server.returncode})\n")
    command = (f"{os.path.relpath(QVL_TRT)} serve {args.repo} --host 127.0.0.1 "
               f"--openai-port {OPENAI_PORT}")
    print(f"To keep one running: {command}\nthen open the chat page at "
          f"http://127.0.0.1:{OPENAI_PORT}/ or ask from Python (pip install openai):\n\n"
          f"{snippet(port=OPENAI_PORT)}")
    return asked.returncode or through_openai.returncode or server.returncode


if __name__ == "__main__":
    raise SystemExit(main())
