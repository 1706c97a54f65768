"""`infer`, `bench` and `verify` against a real tritonserver serving the reference-flavor
repository of the tiny checkpoint (the shared `triton_server` fixture), through real
tritonclient (gRPC) and HTTP generate_stream."""

from __future__ import annotations

import csv
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from cli_harness import run_cli
from PIL import Image

from qvl_trt.client.generate import GenerateClient, GenerateRequest, image_tokens


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("images")
    paths = []
    for n, (w, h) in enumerate(((128, 96), (64, 160))):
        pixels = np.random.default_rng(n).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"img{n}.png")
        paths.append(root / f"img{n}.png")
    return paths


def _http(server) -> str:
    return f"http://{server.http_url}"


def _grpc(server) -> str:
    return f"grpc://{server.grpc_url}"


def test_infer_streams_over_grpc_and_http(triton_server, images):
    args = ["--image", str(images[0]), "--prompt", "What is in the picture?",
            "--max-tokens", "8"]
    streamed = run_cli("infer", "--url", _grpc(triton_server), "--stream", *args)
    assert streamed.returncode == 0, streamed.stderr
    answer, summary = streamed.stdout.rstrip("\n").rsplit("\n", 1)
    assert summary.startswith("TTFT ") and "tokens/s" in summary and "output tokens" in summary

    data = json.loads(run_cli("infer", "--url", _http(triton_server), "--json", *args).stdout)
    assert data["text"] == answer  # the same greedy answer, whole, over the other transport
    assert 0 < data["time_to_first_token_ms"] <= data["request_latency_ms"]
    assert 1 <= data["output_tokens"] <= 8
    with GenerateClient(_grpc(triton_server)) as client:
        bounds = client.request_limits()
        generation = client.generate(GenerateRequest(
            "What is in the picture?", (images[0].read_bytes(),), max_tokens=8))
    expected_image = image_tokens(images[0].read_bytes(), min_pixels=bounds.min_pixels,
                                  max_pixels=bounds.max_pixels)
    assert data["input_image_tokens"] == expected_image > 0
    assert data["input_text_tokens"] + expected_image == generation.prompt_tokens
    assert generation.text == answer and len(generation.responses) > 1  # streamed in chunks
    assert generation.completion_tokens == data["output_tokens"]
    # the deployment's finish reason, as the client reads it: all 8 tokens or an end token
    assert data["finish_reason"] == generation.finish_reason == \
        ("length" if data["output_tokens"] == 8 else "stop")
    assert f"({data['finish_reason']})" in summary


def test_infer_reports_a_refused_request_in_one_line(triton_server, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    result = run_cli("infer", "--url", _grpc(triton_server), "--image", str(broken), "--prompt", "?")
    assert result.returncode == 1 and result.stderr.startswith("error: ")
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, words", [
    (("--prompt", "hi \udcff"), "text_input holds a lone surrogate (U+DCFF at character 3)"),
    (("--prompt", "hi", "--stop", "\udcfe"), "stop[0] holds a lone surrogate (U+DCFE"),
])
@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_infer_refuses_text_utf8_cannot_carry_in_one_line(flags, words, scheme):
    """A byte of argv that is not UTF-8 reaches Python as a lone surrogate: refused by name
    where the tensors are made, before any server is asked (none listens here)."""
    from qvl_trt.serve.server import free_ports

    result = run_cli("infer", "--url", f"{scheme}://127.0.0.1:{free_ports().http}", *flags)
    assert result.returncode == 1 and result.stderr.startswith(f"error: {words}"), result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_bench_numbers_are_consistent(triton_server, tmp_path):
    out = tmp_path / "bench"
    result = run_cli("bench", "--url", _grpc(triton_server), "--synthetic", "96x64",
                     "--concurrency", "1,4", "--requests", "4", "--max-tokens", "6",
                     "--warmup", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "concurrency 1: 4 requests, 0 errors" in result.stdout
    assert "concurrency 4: 4 requests, 0 errors" in result.stdout
    report = json.loads((out / "bench.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    assert report["settings"]["requests"] == 4 and report["settings"]["max_tokens"] == 6
    assert {"qvl_trt", "git_sha", "tensorrt_llm", "gpus"} <= set(report["environment"])
    for lv in report["levels"]:
        records = lv["records"]
        assert len(records) == lv["requests"] == 4 and lv["errors"] == 0
        assert lv["total_output_tokens"] == sum(r["output_tokens"] for r in records)
        assert lv["total_input_image_tokens"] == sum(r["input_image_tokens"] for r in records)
        for r in records:
            assert r["sent"] < r["first_token"] <= r["last_response"]  # TTFT <= latency
            assert 1 <= r["output_tokens"] <= 6 and r["input_image_tokens"] > 0
        duration = max(r["last_response"] for r in records) - min(r["sent"] for r in records)
        assert lv["duration_s"] == pytest.approx(duration)
        assert lv["request_throughput"] == pytest.approx(4 / duration)
        assert lv["output_token_throughput"] == pytest.approx(
            lv["total_output_tokens"] / duration)
        m = lv["metrics"]
        assert m["time_to_first_token"]["max"] <= m["request_latency"]["max"]
        assert m["request_latency"]["p50"] <= m["request_latency"]["p99"]
        assert m["input_sequence_length"]["avg"] == pytest.approx(
            m["input_text_tokens"]["avg"] + m["input_image_tokens"]["avg"])
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert {r["concurrency"] for r in rows} == {"1", "4"}
    with Image.open(out / "bench.png") as png:
        assert png.format == "PNG"


def test_bench_measures_every_path_alike(triton_server, gateway, tmp_path):
    """The same greedy requests (the same images: a fixed seed) through the ensemble, the
    build's tensorrt_llm_bls and the OpenAI endpoint: each request's token counts agree
    across paths, and each path's records satisfy the metric definitions."""
    load = ["--synthetic", "96x64", "--seed", "7", "--concurrency", "2", "--requests", "4",
            "--max-tokens", "6", "--warmup", "0"]
    reports = {}
    for endpoint, url in (("ensemble", _grpc(triton_server)), ("bls", _grpc(triton_server)),
                          ("openai", gateway.url)):
        out = tmp_path / endpoint
        result = run_cli("bench", "--endpoint", endpoint, "--url", url, *load, "--out", str(out))
        assert result.returncode == 0, result.stderr
        assert "concurrency 2: 4 requests, 0 errors" in result.stdout
        reports[endpoint] = json.loads((out / "bench.json").read_text())
    assert reports["bls"]["settings"]["target"] == "tensorrt_llm_bls"
    assert reports["ensemble"]["settings"]["target"] == "ensemble"
    assert reports["openai"]["settings"]["endpoint"] == "openai"
    assert "api_key" not in reports["openai"]["settings"]  # a secret stays out of the files
    counts = {}
    for endpoint, report in reports.items():
        (level,) = report["levels"]
        for r in level["records"]:
            assert r["sent"] < r["first_token"] <= r["last_response"]
        counts[endpoint] = [(r["output_tokens"], r["input_text_tokens"] + r["input_image_tokens"])
                            for r in level["records"]]
        assert level["total_output_tokens"] == sum(n for n, _ in counts[endpoint])
    assert all(n >= 1 and isl > 0 for n, isl in counts["ensemble"])
    assert counts["ensemble"] == counts["bls"] == counts["openai"]
    # every path reports the visual tokens the deployment used (the gateway in its usage)
    assert reports["openai"]["levels"][0]["total_input_image_tokens"] == \
        reports["bls"]["levels"][0]["total_input_image_tokens"] == \
        reports["ensemble"]["levels"][0]["total_input_image_tokens"] > 0


@pytest.mark.parametrize("endpoint", ["ensemble", "openai"])
def test_infer_asks_at_a_budget(triton_server, gateway, tmp_path, endpoint):
    """`infer --budget`: the images at that budget, their tokens as the deployment reports
    them; a budget the command line cannot spell is refused before anything is sent."""
    from PIL import Image

    image = tmp_path / "wide.png"
    Image.new("RGB", (640, 360), (30, 120, 200)).save(image)
    url = gateway.url if endpoint == "openai" else _grpc(triton_server)
    args = ["infer", "--endpoint", endpoint, "--url", url, "--image", str(image),
            "--prompt", "What is in the picture?", "--max-tokens", "2", "--json"]
    counts = {}
    for budget in ("max_pixels=16384", "high"):
        result = run_cli(*args, "--budget", budget)
        assert result.returncode == 0, result.stderr
        counts[budget] = json.loads(result.stdout)["input_image_tokens"]
    with GenerateClient(_grpc(triton_server)) as client:
        bounds = client.request_limits()
    data = image.read_bytes()
    assert counts == {
        "max_pixels=16384": image_tokens(data, min_pixels=bounds.min_pixels, max_pixels=16384),
        "high": image_tokens(data, min_pixels=bounds.min_pixels, max_pixels=bounds.max_pixels)}
    assert counts["max_pixels=16384"] < counts["high"]
    refused = run_cli(*args, "--budget", "max_pixels=lots")
    assert refused.returncode == 1 and refused.stderr.startswith(
        "error: budget 'max_pixels=lots': expected low, high, auto or"), refused.stderr


@pytest.mark.parametrize("endpoint", ["ensemble", "openai"])
def test_bench_sweeps_image_budgets(triton_server, gateway, tmp_path, endpoint):
    """`--budgets`: a run per budget, each request's image tokens as the deployment reports
    them at that budget (640x360 images: 60 tokens at low, the test profile's maximum; 15 at
    16384 pixels), one table comparing them, and the reports in a folder per budget."""
    out = tmp_path / "bench"
    url = gateway.url if endpoint == "openai" else _grpc(triton_server)
    result = run_cli("bench", "--endpoint", endpoint, "--url", url, "--synthetic", "640x360",
                     "--concurrency", "1", "--requests", "2", "--max-tokens", "2", "--warmup",
                     "0", "--budgets", "low,max_pixels=16384", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "image budgets: visual tokens and time to first token" in result.stdout
    assert "max_pixels=16384" in result.stdout  # the budget's name is not cut
    tokens = {}
    for budget in ("low", "max_pixels=16384"):
        report = json.loads((out / budget / "bench.json").read_text())
        assert report["settings"]["budget"] == budget
        (level,) = report["levels"]
        assert level["errors"] == 0
        tokens[budget] = {r["input_image_tokens"] for r in level["records"]}
    assert tokens == {"low": {60}, "max_pixels=16384": {15}}


def test_bench_refuses_an_endpoint_it_cannot_measure(triton_server, gateway):
    result = run_cli("bench", "--endpoint", "openai", "--url", _grpc(triton_server))
    assert result.returncode != 0 and "the OpenAI endpoint is HTTP" in result.stderr
    result = run_cli("bench", "--endpoint", "openai", "--url", gateway.url,
                     "--served-model", "nosuch")
    assert result.returncode == 1 and "--served-model nosuch: the gateway at" in result.stderr
    served = json.loads(urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=10).read())
    assert f"serves {served['data'][0]['id']}; pass one of them" in result.stderr
    result = run_cli("bench", "--endpoint", "chat", "--url", _grpc(triton_server))
    assert result.returncode != 0 and "expected one of ensemble, bls, openai" in result.stderr


def test_a_refused_chat_request_is_one_line_error(gateway):
    from qvl_trt.client.chat import ChatClient
    from qvl_trt.errors import RequestError

    with ChatClient(gateway.url, model="") as probe:
        client = ChatClient(gateway.url, model=probe.served_model())
    with pytest.raises(RequestError) as refused:
        list(client.stream(GenerateRequest("q", (b"\x89PNG\r\n\x1a\n" + b"\0" * 64,))))
    assert str(refused.value).startswith("HTTP 400: ") and "\n" not in str(refused.value)
    with pytest.raises(RequestError, match="HTTP 404: "):
        list(ChatClient(gateway.url, model="nosuch").stream(GenerateRequest("q")))


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    """An MP4 of 20 frames of 96x64 at 10 fps: 4 frames at 2 fps, 2 temporal groups."""
    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    from video_clips import video_file

    path = tmp_path_factory.mktemp("videos") / "clip.mp4"
    path.write_bytes(video_file(20, 96, 64, rate=10, seed=3))
    return path


def test_infer_sends_videos_over_grpc_and_http(triton_server, video, images):
    args = ["--video", str(video), "--image", str(images[0]), "--prompt", "What happens?",
            "--max-tokens", "6", "--json"]
    grpc = json.loads(run_cli("infer", "--url", _grpc(triton_server), *args).stdout)
    http = json.loads(run_cli("infer", "--url", _http(triton_server), *args).stdout)
    assert grpc["text"] == http["text"]
    # 2 groups of 6 tokens (96x64 frames) beside the image: counted as the server does
    with GenerateClient(_grpc(triton_server)) as client:
        bounds = client.request_limits()
    image = image_tokens(images[0].read_bytes(), min_pixels=bounds.min_pixels,
                         max_pixels=bounds.max_pixels)
    assert grpc["input_image_tokens"] == http["input_image_tokens"] == image + 12
    slower = json.loads(run_cli("infer", "--url", _grpc(triton_server), *args,
                                "--video-fps", "1").stdout)  # 2 frames: min_frames makes 4
    assert slower["input_image_tokens"] == image + 12
    missing = run_cli("infer", "--url", _grpc(triton_server), "--video", "nope.mp4",
                      "--prompt", "?")
    assert missing.returncode == 1 and "--video nope.mp4: no such file" in missing.stderr


def test_bench_runs_a_synthetic_video_workload(triton_server, tmp_path):
    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    out = tmp_path / "bench"
    result = run_cli("bench", "--url", _grpc(triton_server), "--synthetic-video", "96x64x6",
                     "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4",
                     "--prompt", "What happens?", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["videos"] == "synthetic video 96x64, 6 frames at 2 fps"
    for lv in report["levels"]:
        assert lv["errors"] == 0
        # 6 frames of 96x64: 3 temporal groups of 6 tokens each
        assert all(r["input_image_tokens"] == 18 for r in lv["records"])
        assert all(r["input_text_tokens"] > 0 for r in lv["records"])


@pytest.fixture(scope="module")
def cases(images, video, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cases") / "cases.jsonl"
    rows = [{"name": "one image", "prompt": "Describe it.", "images": [str(images[0])],
             "max_tokens": 8},
            {"name": "two images", "prompt": "Compare them.",
             "images": [str(p) for p in images], "max_tokens": 6},
            {"name": "text only", "prompt": "Say hello.", "max_tokens": 6},
            {"name": "video and image", "prompt": "What happens?", "images": [str(images[1])],
             "videos": [str(video)], "video_fps": 3, "max_tokens": 6}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_verify_matches_the_reference_pipeline_and_itself(triton_server, tiny_build, tiny_ckpt,
                                                          cases):
    result = run_cli("verify", "--url", _grpc(triton_server), "--against", "reference",
                     "--model", str(tiny_ckpt), "--llm-checkpoint",
                     str(tiny_build / "llm_checkpoint"), "--cases", str(cases))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 cases match" in result.stdout
    itself = run_cli("verify", "--url", _grpc(triton_server), "--against", _grpc(triton_server),
                     "--cases", str(cases), "--json")
    assert itself.returncode == 0, itself.stderr
    assert all(case["passed"] and case["first_divergence"] is None
               for case in json.loads(itself.stdout))


def test_verify_fails_against_another_model(triton_server, tmp_path, cases):
    from qvl_trt.testing.tiny_checkpoint import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"prompt": "Say hello.", "max_tokens": 4}]))
    result = run_cli("verify", "--url", _grpc(triton_server), "--against", "reference",
                     "--model", str(other), "--cases", str(one))
    assert result.returncode == 1
    assert "FAIL case 1: first divergence at token" in result.stdout
    assert "0 of 1 cases match" in result.stdout
