"""NVIDIA AIPerf and `qvl-trt bench --endpoint openai` on the same load through the OpenAI
endpoint, their figures side by side.

AIPerf (AIPERF_VERSION) goes into a throwaway venv of its own (`--venv DIR` keeps and reuses
one; by default a temporary one, removed at the end), never the project's. The endpoint is a
running gateway (`--url http://HOST:PORT`) or one this script serves (`--repository REPO`:
`qvl-trt serve REPO --openai-port` on free ports, stopped at the end). The load: `--requests`
text-only requests at `--concurrency`, one synthetic prompt of `--isl` tokens made by AIPerf
(`--num-dataset-entries 1`) and sent by both (bench reads it from AIPerf's inputs.json), `--osl`
tokens generated, greedy: bench sends temperature 0 and so does AIPerf here (`--extra-inputs
temperature:0`; without it the server samples with the checkpoint's generation_config, which
costs the reference flavor more per token). AIPerf counts tokens with the server's usage
(--use-server-token-count, as bench does) and needs the checkpoint's tokenizer files
(`--tokenizer DIR`, a local checkpoint folder) for its prompt.

A fixed output length is asked of AIPerf the way it documents it, `--extra-inputs
ignore_eos:true min_tokens:OSL` (`--no-fixed-length` leaves both out: the length is then at
most OSL); a server that refuses them fails every AIPerf request, and the script says so with
the server's message. bench is asked the same (`--fixed-length`).

    python scripts/aiperf_compare.py --tokenizer CHECKPOINT (--url http://127.0.0.1:9000 |
        --repository REPO) [--concurrency 4] [--requests 40] [--isl 64] [--osl 16]
        [--no-fixed-length] [--venv DIR] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from qvl_trt.client.chat import ChatClient
from qvl_trt.errors import QvlError
from qvl_trt.serve.server import free_ports

AIPERF_VERSION = "0.13.0"
QVL_TRT = str(Path(sys.executable).with_name("qvl-trt"))
# (row label, AIPerf's metric and statistic, bench's level field or (metric, statistic)).
ROWS = (
    ("requests (errors)", None, None),
    ("request throughput (req/s)", ("request_throughput", "avg"), "request_throughput"),
    ("output token throughput (tok/s)", ("output_token_throughput", "avg"),
     "output_token_throughput"),
    *((f"request latency {s} (ms)", ("request_latency", s), ("request_latency", s))
      for s in ("avg", "p50", "p90", "p99")),
    *((f"time to first token {s} (ms)", ("time_to_first_token", s),
       ("time_to_first_token", s)) for s in ("avg", "p50", "p99")),
    *((f"inter-token latency {s} (ms)", ("inter_token_latency", s),
       ("inter_token_latency", s)) for s in ("avg", "p50")),
    ("output sequence length avg", ("output_sequence_length", "avg"),
     ("output_sequence_length", "avg")),
    ("input sequence length avg", ("input_sequence_length", "avg"),
     ("input_sequence_length", "avg")),
)


def aiperf_venv(folder: Path) -> Path:
    """The aiperf executable of a venv at `folder` holding AIPERF_VERSION, made if needed."""
    exe = folder / "bin" / "aiperf"
    if exe.exists() and subprocess.run([exe, "--version"], capture_output=True, text=True
                                       ).stdout.strip() == AIPERF_VERSION:
        return exe
    print(f"installing aiperf=={AIPERF_VERSION} into {folder} (a venv of its own)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", folder], check=True)
    subprocess.run([folder / "bin" / "python", "-m", "pip", "install", "-q",
                    f"aiperf=={AIPERF_VERSION}"], check=True)
    return exe


@contextlib.contextmanager
def endpoint(args, work: Path) -> Iterator[str]:
    """The gateway's URL: --url, or a `qvl-trt serve --openai-port` of --repository."""
    if args.url:
        yield args.url
        return
    port = free_ports().http
    serve = subprocess.Popen([QVL_TRT, "serve", str(args.repository), "--free-ports",
                              "--host", "127.0.0.1", "--openai-port", str(port),
                              "--log-file", str(work / "server.log")],
                             stdout=(work / "serve.out").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                ChatClient(url, model="").served_model()
                break
            except QvlError:
                if serve.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"qvl-trt serve did not come up; see {work / 'serve.out'}")
                time.sleep(2)
        yield url
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=120)


def child_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes, their children included:
    what a measuring tool took from the machine it shares with the server."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_aiperf(exe: Path, url: str, model: str, args, out: Path) -> dict:
    command = [exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(args.tokenizer),
               "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
               "--warmup-request-count", "1", "--isl", str(args.isl), "--isl-stddev", "0",
               "--osl", str(args.osl), "--num-dataset-entries", "1",
               "--extra-inputs", "temperature:0", "--use-server-token-count", "--ui", "none",
               "--no-server-metrics", "--artifact-dir", str(out)]
    if args.fixed_length:
        command += ["--extra-inputs", "ignore_eos:true", "--extra-inputs",
                    f"min_tokens:{args.osl}"]
    print("$ " + " ".join(map(str, command)), flush=True)
    cpu, load = child_cpu(), os.getloadavg()[0]
    with (out.parent / "aiperf.out").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    export = out / "profile_export_aiperf.json"
    if not export.exists():
        sys.exit(f"AIPerf wrote no results: {first_error(out) or 'see ' + str(out.parent)}"
                 + ("; a server that refuses ignore_eos or min_tokens fails every request of "
                    "a fixed output length: try --no-fixed-length" if args.fixed_length else ""))
    return {**json.loads(export.read_text()), "client_cpu_s": child_cpu() - cpu,
            "load_average": load}


def first_error(out: Path) -> str | None:
    """The server's message in AIPerf's first failed record."""
    records = out / "profile_export.jsonl"
    for line in records.read_text().splitlines() if records.exists() else ():
        error = json.loads(line).get("error")
        if error:
            try:
                return json.loads(error["message"])["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return str(error.get("message"))
    return None


def run_bench(url: str, model: str, prompt: str, args, out: Path) -> dict:
    command = [QVL_TRT, "bench", "--endpoint", "openai", "--url", url, "--served-model", model,
               "--concurrency", str(args.concurrency), "--requests", str(args.requests),
               "--max-tokens", str(args.osl), "--warmup", "1", "--prompt", prompt,
               "--out", str(out), *(["--fixed-length"] if args.fixed_length else [])]
    print(f"$ qvl-trt bench --endpoint openai --url {url} --concurrency {args.concurrency} "
          f"--requests {args.requests} --max-tokens {args.osl}"
          f"{' --fixed-length' if args.fixed_length else ''} --prompt <AIPerf's first>",
          flush=True)
    cpu, load = child_cpu(), os.getloadavg()[0]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"qvl-trt bench failed: {result.stderr.strip()}")
    (level,) = json.loads((out / "bench.json").read_text())["levels"]
    return {**level, "client_cpu_s": child_cpu() - cpu, "load_average": load}


def table(aiperf: dict, bench: dict) -> str:
    def fmt(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"{'':34}{'AIPerf ' + AIPERF_VERSION:>16}{'qvl-trt bench':>16}"]
    for label, ours_of_aiperf, of_bench in ROWS:
        if ours_of_aiperf is None:
            errors = sum(e.get("count", 0) for e in aiperf.get("error_summary") or [])
            a = f"{int(aiperf['request_count']['avg'])} ({errors})"
            b = f"{bench['requests']} ({bench['errors']})"
        else:
            metric, stat = ours_of_aiperf
            a = fmt(aiperf.get(metric, {}).get(stat))
            b = fmt(bench[of_bench] if isinstance(of_bench, str)
                    else (bench["metrics"][of_bench[0]] or {}).get(of_bench[1]))
        lines.append(f"{label:34}{a:>16}{b:>16}")
    for label, key in (("client CPU, start-up included (s)", "client_cpu_s"),
                       ("load average at start (1 min)", "load_average")):
        lines.append(f"{label:34}{aiperf[key]:>16.2f}{bench[key]:>16.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running gateway, http://HOST:PORT")
    where.add_argument("--repository", type=Path, help="serve this repository meanwhile")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="the checkpoint folder (its tokenizer files) for AIPerf")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--isl", type=int, default=64, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=16, help="output tokens")
    parser.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                        help="send AIPerf's ignore_eos and min_tokens (default: yes)")
    parser.add_argument("--venv", type=Path, help="keep AIPerf's venv here and reuse it")
    parser.add_argument("--work-dir", type=Path, help="keep the results here")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").exists():
        sys.exit(f"--tokenizer {args.tokenizer}: no tokenizer.json in it; pass the checkpoint "
                 "folder")
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        venv = args.venv or work / "aiperf-venv"
        if not args.venv:
            stack.callback(shutil.rmtree, venv, ignore_errors=True)
        exe = aiperf_venv(venv)
        url = stack.enter_context(endpoint(args, work))
        model = ChatClient(url, model="").served_model()
        aiperf = run_aiperf(exe, url, model, args, work / "aiperf")
        inputs = json.loads((work / "aiperf" / "inputs.json").read_text())
        prompt = inputs["data"][0]["payloads"][0]["messages"][0]["content"]
        bench = run_bench(url, model, prompt, args, work / "bench")
    print(f"\n{args.requests} requests at concurrency {args.concurrency}, {args.isl} prompt "
          f"tokens, {args.osl} output tokens ({'fixed' if args.fixed_length else 'at most'}), "
          f"model {model} at {url}")
    print(table(aiperf, bench))


if __name__ == "__main__":
    main()
