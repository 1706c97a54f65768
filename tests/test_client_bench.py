"""Benchmark outputs (JSON, CSV, PNG, table) and request building, without a server."""

from __future__ import annotations

import base64
import csv
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from qvl_trt.cli.console import bench_tables, infer_json, infer_line
from qvl_trt.client.bench import (
    BenchReport,
    BenchSettings,
    image_source,
    measure,
    parse_concurrency,
    parse_size,
    request_maker,
    require_loopback,
    synthetic_images,
)
from qvl_trt.client.bench_report import report_csv, write_reports
from qvl_trt.client.generate import (
    GenerateRequest,
    RequestError,
    Response,
    ensemble_request,
    http_body,
    image_tokens,
    parse_url,
)
from qvl_trt.client.metrics import RequestRecord, level_metrics
from qvl_trt.errors import InputError
from qvl_trt.triton import contract as c

LEVEL_1 = [RequestRecord(0.0, 0.1, 0.5, 5, 20, 64), RequestRecord(0.5, 0.6, 1.0, 5, 20, 64)]
LEVEL_4 = [RequestRecord(0.0, 0.2, 0.6, 3, 20, 64), RequestRecord(0.0, 0.3, 0.7, 3, 20, 64),
           RequestRecord(0.1, None, None, error="HTTP 400: image is corrupt")]


@pytest.fixture
def report() -> BenchReport:
    levels = (level_metrics(1, LEVEL_1), level_metrics(4, LEVEL_4))
    return BenchReport({"url": "grpc://127.0.0.1:1"}, {"qvl_trt": "0"}, levels,
                       {1: LEVEL_1, 4: LEVEL_4})


def test_files_agree_with_the_metrics(report, tmp_path):
    paths = write_reports(report, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    c1, c4 = data["levels"]
    assert c1["total_output_tokens"] == sum(r["output_tokens"] for r in c1["records"]) == 10
    assert c4["errors"] == 1 and c4["records"][2]["error"].startswith("HTTP 400")
    assert c1["metrics"]["request_latency"]["p50"] == pytest.approx(500.0)
    assert c1["metrics"]["request_latency"]["unit"] == "ms"
    assert "text tokens + image tokens" in data["input_sequence_length"]

    rows = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    by = {(r["concurrency"], r["metric"]): r for r in rows}
    assert float(by["4", "output_token_throughput"]["value"]) == pytest.approx(6 / 0.7)
    assert float(by["1", "time_to_first_token"]["p99"]) == pytest.approx(100.0)
    assert by["4", "errors"]["value"] == "1"

    with Image.open(paths["png"]) as png:
        assert png.format == "PNG" and png.size[0] > 400
    assert sorted(p.name for p in paths["json"].parent.iterdir()) == \
        ["bench.csv", "bench.json", "bench.png"]


def test_a_failed_plot_keeps_the_previous_one_and_leaves_no_partial_file(report, tmp_path,
                                                                        monkeypatch):
    from matplotlib.figure import Figure

    paths = write_reports(report, tmp_path / "out")
    before = paths["png"].read_bytes()

    def half_written(self, target, **kwargs):  # a file name or an open file
        with open(target, "wb") if isinstance(target, (str, Path)) else target as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError, match="disk full"):
        write_reports(report, tmp_path / "out")
    assert paths["png"].read_bytes() == before
    assert sorted(p.name for p in paths["png"].parent.iterdir()) == \
        ["bench.csv", "bench.json", "bench.png"]


def test_table_shows_every_level(report):
    console = Console(file=io.StringIO(), width=160)
    for table in bench_tables(report.levels):
        console.print(table)
    text = " ".join(console.file.getvalue().split())
    assert "concurrency 1: 2 requests, 0 errors" in text
    assert "concurrency 4: 3 requests, 1 errors" in text
    assert "TTFT (ms)" in text and "input sequence length counts both" in text


def test_csv_has_a_row_per_level_and_metric(report):
    rows = report_csv(report).splitlines()
    assert rows[0].startswith("concurrency,metric,unit,value,avg")
    assert len(rows) == 1 + 2 * (8 + 8)


def test_the_ensemble_request_follows_the_contract():
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    req = GenerateRequest("hi", (b"img",), max_tokens=7, top_k=3, stop=("x",), stream=False)
    fields = ensemble_request(req).to_tensors()
    specs = {s.name: s for s in c.ENSEMBLE_INPUTS}
    for name, value in fields.items():
        assert np_to_triton_dtype(value.dtype) == specs[name].data_type
        assert value.shape[0] == 1  # batch of one
    assert [(i.name(), i.datatype()) for i in ensemble_request(req).infer_inputs(InferInput)] \
        == [(name, specs[name].data_type) for name in fields]
    assert fields[c.IMAGE_BYTES].shape == (1, 1)
    assert c.TOP_P not in fields and c.SEED not in fields
    body = http_body(req)
    assert body[c.MAX_TOKENS] == 7 and body[c.STREAM] is False and body[c.STOP] == ["x"]
    assert body[c.IMAGE_BYTES][0].startswith("data:image/octet-stream;base64,")
    with pytest.raises(InputError, match="max tokens must be positive"):
        ensemble_request(GenerateRequest("hi", max_tokens=0))


def test_synthetic_images_differ_and_count_tokens():
    make = synthetic_images(64, 48)
    a, b = make(0), make(1)
    assert a != b and make(0) == a
    with Image.open(io.BytesIO(a)) as im:
        assert im.size == (64, 48) and im.format == "JPEG"
    # 64x48 rounds to 64x64 = 4 merged tokens of 32x32 without bounds in the way
    assert image_tokens(a, min_pixels=32 * 32, max_pixels=10**6) == 4
    assert http_body(GenerateRequest("q", (a,)))[c.IMAGE_BYTES][0].startswith(
        "data:image/jpeg;base64,")
    assert base64.b64decode(http_body(GenerateRequest("q", (a,)))[c.IMAGE_BYTES][0]
                            .split(",", 1)[1]) == a


def test_synthetic_images_are_new_every_run_unless_seeded():
    # a second run against the same server must not hit the first run's vision cache
    assert synthetic_images(16, 16)(0) != synthetic_images(16, 16)(0)
    assert synthetic_images(16, 16, seed=3)(0) == synthetic_images(16, 16, seed=3)(0)
    assert synthetic_images(16, 16, seed=3)(0) != synthetic_images(16, 16, seed=4)(0)
    assert image_source(None, "16x16", 3)[0](1) == synthetic_images(16, 16, seed=3)(1)


def test_request_maker_gives_each_level_new_images():
    calls = []
    settings = BenchSettings("grpc://127.0.0.1:1", (1,), 3, 8, images_per_request=2)
    make = request_maker(settings, lambda n: calls.append(n) or bytes([n]), first=5)
    assert make(0).images == (bytes([10]), bytes([11])) and make(2).images == (b"\x0e", b"\x0f")
    text_only = request_maker(settings, None)(0)
    assert text_only.images == () and text_only.max_tokens == 8


def test_bench_settings_read_the_levels_and_the_endpoint_as_the_command_line_gives_them():
    from qvl_trt.client.bench import BenchEndpoint

    settings = BenchSettings("grpc://127.0.0.1:1", "1, 4", 1, 8, endpoint="bls")
    assert settings.concurrency == (1, 4) and settings.endpoint is BenchEndpoint.BLS
    with pytest.raises(InputError, match="--concurrency '0'"):
        BenchSettings("grpc://127.0.0.1:1", "0", 1, 8)
    with pytest.raises(InputError, match="--endpoint 'chat'"):
        BenchSettings("grpc://127.0.0.1:1", (1,), 1, 8, endpoint="chat")


def test_budgets_read_as_the_command_line_gives_them_and_ride_in_the_messages():
    """`--budgets low,max_pixels=N,min_pixels=N:max_pixels=N`: each a chat_messages
    ImageBudget; a request with one goes as chat messages whose image parts carry it, read
    back as the same budget (the text form has no part to carry it)."""
    from qvl_trt.chat_messages import ImageBudget, read_messages

    settings = BenchSettings("grpc://127.0.0.1:1", (1,), 1, 8,
                             budgets="low, max_pixels=65536,min_pixels=4096:max_pixels=16384")
    assert settings.budgets == (ImageBudget("low", where="low"),
                                ImageBudget(max_pixels=65536, where="max_pixels=65536"),
                                ImageBudget(min_pixels=4096, max_pixels=16384,
                                            where="min_pixels=4096:max_pixels=16384"))
    for bad in ("medium", "max_pixels=lots", "size=3", "min_pixels=9:max_pixels=8"):
        with pytest.raises(InputError, match=bad.split("=")[0]):
            BenchSettings("grpc://127.0.0.1:1", (1,), 1, 8, budgets=bad)
    for budget in settings.budgets:
        req = request_maker(settings, synthetic_images(64, 48), budget=budget)(0)
        fields = ensemble_request(req)
        assert fields.text_input is None and fields.image_bytes == ()
        (part,) = read_messages(json.loads(fields.messages)).image_budgets
        assert (part.detail, part.min_pixels, part.max_pixels) == (
            budget.detail, budget.min_pixels, budget.max_pixels)
    plain = ensemble_request(request_maker(settings, synthetic_images(64, 48))(0))
    assert plain.messages is None and len(plain.image_bytes) == 1


def test_option_parsing_and_loopback_guard():
    assert parse_concurrency("1, 4,16") == (1, 4, 16)
    assert parse_size("640x480") == (640, 480)
    for bad in ("0", "a,b", ""):
        with pytest.raises(InputError, match="--concurrency"):
            parse_concurrency(bad)
    with pytest.raises(InputError, match="WIDTHxHEIGHT"):
        parse_size("640")
    assert parse_url("127.0.0.1:9").protocol == "grpc"
    assert parse_url("http://localhost").port == 8000
    with pytest.raises(InputError, match="grpc://HOST:PORT"):
        parse_url("ftp://x")
    require_loopback(parse_url("grpc://localhost:8001"))
    with pytest.raises(InputError, match="not a loopback address.*--allow-remote"):
        require_loopback(parse_url("grpc://192.0.2.1:8001"))


class FakeClient:
    """Sends at t=1.0 and answers with `responses`, then fails with `error` if given."""

    def __init__(self, responses: list[Response], error: str | None = None) -> None:
        self.responses, self.error = responses, error

    def stream(self, req, *, sent_at: list):
        sent_at.append(1.0)
        yield from self.responses
        if self.error:
            raise RequestError(self.error)


STREAM = [Response(1.2, "", 90, 0), Response(1.5, "Hel", 90, 1),
          Response(2.0, "lo", 90, 2, "length")]


def test_measure_times_the_request_and_counts_text_tokens_apart():
    seen = []
    answer = measure(FakeClient(STREAM), GenerateRequest("hi"), 64, on_response=seen.append)
    assert seen == STREAM and answer.text == "Hello"
    assert answer.record == RequestRecord(1.0, 1.5, 2.0, 2, 26, 64)
    answer.raise_if_failed()
    assert infer_line(answer) == ("[dim]TTFT 500.0 ms, 2.0 tokens/s, latency 1.00 s; 2 output "
                                  "tokens (length), prompt 90 tokens (26 text + 64 image)[/dim]")
    assert infer_json(answer) == {
        "text": "Hello", "time_to_first_token_ms": pytest.approx(500.0),
        "request_latency_ms": pytest.approx(1000.0), "output_tokens_per_s": pytest.approx(2.0),
        "output_tokens": 2, "finish_reason": "length", "input_text_tokens": 26,
        "input_image_tokens": 64}


def test_a_failed_request_becomes_a_record_with_its_error():
    answer = measure(FakeClient(STREAM[:2], error="HTTP 400: image is corrupt"),
                     GenerateRequest("hi"), 64)
    assert answer.text == "Hel"
    assert answer.record == RequestRecord(1.0, None, None, error="HTTP 400: image is corrupt")
    with pytest.raises(RequestError, match="image is corrupt"):
        answer.raise_if_failed()


def test_image_source_takes_one_of_folder_or_synthetic(tmp_path):
    assert image_source(None, None) == (None, "none (text only)")
    images, name = image_source(None, "32x16")
    assert name == "synthetic 32x16" and Image.open(io.BytesIO(images(0))).size == (32, 16)
    with pytest.raises(InputError, match="not both"):
        image_source(tmp_path, "32x16")


# The OpenAI endpoint's stream: a role chunk, content chunks without counts, the usage chunk.
CHAT_STREAM = [Response(1.2, "", 0, 0), Response(1.5, "Hel", 0, 0), Response(2.0, "lo", 0, 0),
               Response(2.1, "", 90, 2, "length")]


def test_the_openai_stream_is_measured_as_the_ensembles():
    # first content chunk = first token; the usage chunk's counts; its arrival ends the request
    answer = measure(FakeClient(CHAT_STREAM), GenerateRequest("hi"), 0)
    assert answer.text == "Hello" and answer.finish_reason == "length"
    assert answer.record == RequestRecord(1.0, 1.5, 2.1, 2, 90, 0)


def test_the_chat_request_asks_for_a_stream_with_usage():
    from qvl_trt.client.chat import chat_body, openai_endpoint

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    body = chat_body(GenerateRequest("q", (png.getvalue(),), max_tokens=5, seed=3,
                                     videos=(b"mp4",)), "tiny")
    assert body["model"] == "tiny" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    text, image, video = body["messages"][0]["content"]
    assert text == {"type": "text", "text": "q"}
    assert image["image_url"]["url"].startswith("data:image/png;base64,")
    assert video["video_url"]["url"] == "data:video/mp4;base64," + base64.b64encode(b"mp4").decode()
    assert body["seed"] == 3 and "top_p" not in body and "stop" not in body
    assert "min_tokens" not in body and "ignore_eos" not in body
    with pytest.raises(InputError, match="max tokens must be positive"):
        chat_body(GenerateRequest("q", max_tokens=0), "tiny")
    with pytest.raises(InputError, match="the OpenAI endpoint is HTTP"):
        openai_endpoint("grpc://127.0.0.1:8001")


def test_a_fixed_output_length_is_asked_for_alike_on_every_path():
    """--fixed-length: min_tokens = max_tokens and the end token ignored, in the chat body and
    in the ensemble's tensors (the same names)."""
    from qvl_trt.client.chat import chat_body
    from qvl_trt.client.generate import ensemble_request

    req = GenerateRequest("q", max_tokens=7, fixed_length=True)
    body = chat_body(req, "tiny")
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (7, 7, True)
    tensors = ensemble_request(req).to_tensors()
    assert tensors[c.MIN_TOKENS].tolist() == [[7]] and tensors[c.IGNORE_EOS].tolist() == [[True]]
    assert c.MIN_TOKENS not in ensemble_request(GenerateRequest("q")).to_tensors()


def test_the_bls_endpoint_targets_the_builds_bls_model():
    from qvl_trt.client.bench import BenchEndpoint

    settings = BenchSettings("grpc://127.0.0.1:1", (1,), 1, 8, endpoint=BenchEndpoint.BLS)
    assert settings.target() == c.TENSORRT_LLM_BLS
    assert replace(settings, model="b2").target() == "b2_tensorrt_llm_bls"
    assert replace(settings, endpoint=BenchEndpoint.ENSEMBLE, model="b2").target() == "b2"
    assert BenchEndpoint.parse("openai") is BenchEndpoint.OPENAI
    with pytest.raises(InputError, match="expected one of ensemble, bls, openai"):
        BenchEndpoint.parse("chat")
