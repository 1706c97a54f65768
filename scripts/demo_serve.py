"""The serving half of `make demo`: `qvl-trt serve REPO` on free ports, one question about a
generated picture with `qvl-trt infer --stream` (the answer as it arrives, then the timings),
then Ctrl-C to the server, which stops it cleanly.

Usage: python scripts/demo_serve.py REPO [--work-dir DIR] [--prompt TEXT] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from PIL import Image, ImageDraw

from qvl_trt.triton.server import free_ports

QVL_TRT = str(Path(sys.executable).with_name("qvl-trt"))


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
    ports = free_ports()
    log = args.work_dir / "server.log"
    print(f"serving {args.repo} (log: {log})", flush=True)
    server = subprocess.Popen(
        [QVL_TRT, "serve", str(args.repo), "--host", "127.0.0.1", "--http-port",
         str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
         "--log-file", str(log)])
    try:
        wait_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready", server, 300)
        print(f"asking about {image}: {args.prompt!r}", flush=True)
        asked = subprocess.run(
            [QVL_TRT, "infer", "--url", f"grpc://127.0.0.1:{ports.grpc}", "--image", str(image),
             "--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--stream"])
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C does
        server.wait(timeout=120)
    print(f"server stopped (exit code {server.returncode})")
    return asked.returncode


if __name__ == "__main__":
    raise SystemExit(main())
