"""Memory over a long run: --requests requests of mixed sizes through a served reference
repository (the tiny checkpoint, small limits) from --clients concurrent clients, printing
every --every requests the RSS of tritonserver and of each python backend stub, then a
verdict per process: the curve levels off when its growth over the last quarter of the run
is below --threshold-mib.

The requests cycle through: a short question alone; a JPEG of 320x240, 640x480,
1280x720 or 4000x3000; a PNG of 800x600; two images; a prompt above max_input_len (refused
by its size); a corrupt image (refused), each with a few generated tokens. Refusals are
counted, not errors of the run; any other failure stops it.

    python scripts/soak.py [--requests 2000] [--clients 4] [--every 100] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_preprocess import photo_like

from qvl_trt.client.generate import GenerateClient, GenerateRequest
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.tiny_repository import build_tiny_reference_repo


def request_mix() -> list[tuple[str, GenerateRequest, bool]]:
    """(name, request, refused?) of each kind the run cycles through."""
    def jpeg(w: int, h: int) -> bytes:
        return photo_like(w, h, "jpeg")

    ask = "Describe this in a few words."
    return [
        ("text", GenerateRequest("Say hello.", max_tokens=4), False),
        ("jpeg_320", GenerateRequest(ask, images=(jpeg(320, 240),), max_tokens=4), False),
        ("jpeg_640", GenerateRequest(ask, images=(jpeg(640, 480),), max_tokens=4), False),
        ("jpeg_1280", GenerateRequest(ask, images=(jpeg(1280, 720),), max_tokens=4), False),
        ("png_800", GenerateRequest(ask, images=(photo_like(800, 600, "png"),), max_tokens=4),
         False),
        ("jpeg_4000", GenerateRequest(ask, images=(jpeg(4000, 3000),), max_tokens=4), False),
        ("two_images", GenerateRequest("Compare them.", images=(jpeg(640, 480), jpeg(480, 640)),
                                       max_tokens=4), False),
        ("long_prompt", GenerateRequest("word " * 30000, max_tokens=4), True),
        ("corrupt_image", GenerateRequest(ask, images=(jpeg(640, 480)[:2000],), max_tokens=4),
         True),
    ]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def processes(server_pid: int) -> dict[str, int]:
    """tritonserver and its python stubs, by the model each stub runs."""
    found = {"tritonserver": server_pid}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
            if int(fields.get("PPid", "0")) != server_pid:
                continue
            argv = (status.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone meanwhile
        model = next((Path(a.decode()).parent.parent.name for a in argv
                      if a.endswith(b"model.py")), None)
        if model:
            found[model] = int(status.parent.name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--every", type=int, default=100, help="requests between samples")
    parser.add_argument("--threshold-mib", type=float, default=10.0,
                        help="growth over the last quarter below which a curve levels off")
    parser.add_argument("--work-dir", type=Path, help="where to build (default: a temporary "
                        "folder, removed at the end)")
    args = parser.parse_args()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    mix = request_mix()
    with tempfile.TemporaryDirectory(prefix="qvl-soak-") as tmp:
        root = args.work_dir or Path(tmp)
        repo = build_tiny_reference_repo(root).path
        with TritonServer(ServerOptions(repo, free_ports()), log_file=root / "server.log",
                          startup_timeout_s=300) as server:
            procs = processes(server.process.pid)
            names = list(procs)
            print(f"revision {revision}; {args.requests} requests, {args.clients} clients, "
                  f"mix: {', '.join(n for n, *_ in mix)}")
            print(f"{'requests':>8} {'s':>6} " + " ".join(f"{n[:16]:>16}" for n in names)
                  + "  (RSS MiB)")
            samples: list[list[float]] = []
            done, refused, lock = 0, 0, threading.Lock()
            kinds = itertools.cycle(mix)
            local = threading.local()
            start = time.monotonic()

            def sample() -> None:
                row = [rss_mib(procs[n]) for n in names]
                samples.append(row)
                print(f"{done:>8} {time.monotonic() - start:6.0f} "
                      + " ".join(f"{v:16.1f}" for v in row), flush=True)

            def one(kind: tuple[str, GenerateRequest, bool]) -> None:
                nonlocal done, refused
                name, request, expect_refusal = kind
                if not hasattr(local, "client"):
                    local.client = GenerateClient(server.grpc_url)
                try:
                    local.client.generate(request)
                    if expect_refusal:
                        raise SystemExit(f"{name} was answered, a refusal was expected")
                except SystemExit:
                    raise
                except Exception as exc:
                    if not expect_refusal:
                        raise SystemExit(f"{name} failed: {exc}") from None
                    with lock:
                        refused += 1
                with lock:
                    done += 1
                    if done % args.every == 0:
                        sample()

            sample()
            with ThreadPoolExecutor(args.clients) as pool:
                for future in [pool.submit(one, next(kinds)) for _ in range(args.requests)]:
                    future.result()
    seconds = time.monotonic() - start
    print(f"{done} requests in {seconds:.0f} s ({done / seconds:.1f}/s), {refused} refused as "
          "expected")
    quarter = samples[-(len(samples) // 4 + 1):]
    for i, name in enumerate(names):
        first, peak, last = samples[0][i], max(s[i] for s in samples), samples[-1][i]
        growth = quarter[-1][i] - quarter[0][i]
        verdict = "levels off" if growth < args.threshold_mib else "still growing"
        print(f"{name:<24} start {first:7.1f}  peak {peak:7.1f}  end {last:7.1f} MiB; last "
              f"quarter {growth:+.1f} MiB: {verdict}")


if __name__ == "__main__":
    main()
