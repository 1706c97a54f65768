"""The reference-flavor repository of the tiny build, served by a real tritonserver (the
nvidia-pytriton build, python backend) and called with the real tritonclient: streamed
answers equal the in-process reference pipeline, concurrent requests stay apart, the vision
cache hits on a repeated image, and bad requests get clear errors without hurting the server.
One server for the session (`triton_server` in conftest.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import queue
import re
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qvl_trt.testing.small_profile import LIMITS
from qvl_trt.triton import contract as c

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")
pytest.importorskip("torch", reason="the reference flavor runs PyTorch: pip install "
                    "'qvl-trt[export]'")


# Ensemble input name -> its Triton data type.
ENSEMBLE_TYPES = {s.name: s.data_type for s in c.ENSEMBLE_INPUTS}


def png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclasses.dataclass
class Answer:
    chunks: list[str]  # text of each response
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.chunks)


class RequestFailed(Exception):
    pass


def grpc_ask(server, *, prompt: str | None = None, images=(), messages=None,
             max_tokens: int = 12, temperature: float | None = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stream: bool = True, stop=(), model: str = c.ENSEMBLE, videos=(),
             video_fps: float | None = None, min_tokens: int | None = None,
             ignore_eos: bool | None = None) -> Answer:
    """One request through the ensemble (`model`) over gRPC streaming; a setting that is
    None is left out (the checkpoint's generation defaults apply)."""
    values = {c.MAX_TOKENS: np.array([[max_tokens]], np.int32),
              c.STREAM: np.array([[stream]])}
    if temperature is not None:
        values[c.TEMPERATURE] = np.array([[temperature]], np.float32)
    if messages is not None:
        values[c.MESSAGES] = np.array([[json.dumps(messages).encode()]], object)
    else:
        values[c.TEXT_INPUT] = np.array([[prompt.encode()]], object)
    if images:
        values[c.IMAGE_BYTES] = np.array([list(images)], object)
    if videos:
        values[c.VIDEO_BYTES] = np.array([list(videos)], object)
    if video_fps is not None:
        values[c.VIDEO_FPS] = np.array([[video_fps]], np.float32)
    if seed is not None:
        values[c.SEED] = np.array([[seed]], np.uint64)
    if top_k is not None:
        values[c.TOP_K] = np.array([[top_k]], np.int32)
    if top_p is not None:
        values[c.TOP_P] = np.array([[top_p]], np.float32)
    if stop:
        values[c.STOP] = np.array([[s.encode() for s in stop]], object)
    if min_tokens is not None:
        values[c.MIN_TOKENS] = np.array([[min_tokens]], np.int32)
    if ignore_eos is not None:
        values[c.IGNORE_EOS] = np.array([[ignore_eos]])
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), ENSEMBLE_TYPES[name])
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    answer = Answer([], 0, 0)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise RequestFailed(str(error))
            text = result.as_numpy(c.TEXT_OUTPUT)
            if text is not None:
                answer.chunks.append(text.reshape(-1)[0].decode())
                answer.prompt_tokens = int(result.as_numpy(c.PROMPT_TOKENS).reshape(-1)[0])
                answer.completion_tokens = int(
                    result.as_numpy(c.COMPLETION_TOKENS).reshape(-1)[0])
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return answer
    finally:
        client.stop_stream()
        client.close()


def http_ask(server, body: dict) -> Answer:
    """One request over HTTP generate_stream (server-sent events)."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{c.ENSEMBLE}/generate_stream",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    answer = Answer([], 0, 0)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as exc:  # an error before the first event (status 400)
        body = exc.read().decode()
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            raise RequestFailed(event["error"])
        answer.chunks.append(event[c.TEXT_OUTPUT])
        answer.prompt_tokens = event[c.PROMPT_TOKENS]
        answer.completion_tokens = event[c.COMPLETION_TOKENS]
    return answer


@pytest.fixture(scope="module")
def video_clip() -> bytes:
    """An MP4 of 30 frames of 96x64 at 10 fps: 6 frames at 2 fps, 3 temporal groups."""
    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    from video_clips import video_file

    return video_file(30, 96, 64, rate=10, seed=7)


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt: Path, tiny_build: Path, triton_profile: Path):
    """The in-process reference pipeline on the build's converted checkpoint, preprocessing
    with the deployment's limits (so both sides resize images alike)."""
    from qvl_trt.llm.pipeline import ReferencePipeline
    from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
    from qvl_trt.profiles import load_profile

    pipe = ReferencePipeline.load(tiny_ckpt, checkpoint=tiny_build / "llm_checkpoint")
    pipe.preprocessor = RequestPreprocessor.from_checkpoint(
        tiny_ckpt, RequestLimits.from_profile(load_profile(str(triton_profile))))
    return pipe


def expected(pipeline, prompt: str, images=(), *, max_tokens: int = 12, **sampling):
    from qvl_trt.llm.pipeline import sampling_params

    params = sampling_params(pipeline.checkpoint.path, max_tokens=max_tokens,
                             greedy=not sampling, **sampling)
    return pipeline.ask(prompt, list(images), sampling=params)


def counts(pipeline, want) -> tuple[int, int]:
    """The prompt_tokens and completion_tokens the server reports for the pipeline's answer
    `want` (the end token is not counted)."""
    return want.prompt_tokens, len(want.token_ids) - (want.token_ids[-1] in
                                                       pipeline.stop_token_ids)


def samples_at(url: str):
    """A metrics page's samples (qvl_trt.serve.progress reads what serve watches)."""
    from qvl_trt.serve.progress import read_metrics

    samples = read_metrics(url, timeout_s=10)
    assert samples is not None, f"{url} does not answer"
    return samples


def metric(server, name: str, **labels: str) -> float:
    from qvl_trt.serve.progress import total

    return total(samples_at(server.metrics_url), name, **labels)


def iterations(server) -> float:
    """tensorrt_llm's iteration counter, the stock backend's metric the reference publishes
    too: while one request generates, one iteration per token."""
    from qvl_trt.serve.progress import iterations as count

    return count(samples_at(server.metrics_url))


# ---- answers --------------------------------------------------------------------------------

def test_grpc_stream_equals_the_reference_pipeline(triton_server, pipeline) -> None:
    image = png(0)
    want = expected(pipeline, "What is in the picture?", [image])
    got = grpc_ask(triton_server, prompt="What is in the picture?", images=[image])
    assert got.text == want.text
    assert sum(1 for chunk in got.chunks if chunk) >= 3, "the answer should come in pieces"
    assert (got.prompt_tokens, got.completion_tokens) == counts(pipeline, want)


def test_http_generate_stream_with_chat_messages_gives_the_same_text(triton_server,
                                                                    pipeline) -> None:
    image = png(0)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "text", "text": "What is in the picture?"}]}]
    got = http_ask(triton_server, {c.MESSAGES: json.dumps(messages), c.MAX_TOKENS: 12,
                                   c.TEMPERATURE: 0.0, c.STREAM: True})
    assert got.text == expected(pipeline, "What is in the picture?", [image]).text
    assert sum(1 for chunk in got.chunks if chunk) >= 3


def test_seeded_sampling_over_the_whole_vocabulary_matches_the_pipeline(triton_server,
                                                                         pipeline) -> None:
    """Sampling the whole vocabulary of a random model draws arbitrary tokens (with this seed
    one is a lone byte that decodes to U+FFFD): the streamed text still equals the one-shot
    decode, and the seed gives the pipeline's tokens. Characters split across streamed
    tokens are covered with the real tokenizer in test_mm_detokenizer.py."""
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0, seed=9)
    want = expected(pipeline, "Say something.", max_tokens=24, **sampling)
    assert "\ufffd" in want.text
    got = grpc_ask(triton_server, prompt="Say something.", max_tokens=24, **sampling)
    assert got.text == want.text


def test_non_streaming_answer_comes_in_one_response(triton_server, pipeline) -> None:
    got = grpc_ask(triton_server, prompt="Hello", images=[png(5, (96, 64))], stream=False)
    assert [chunk for chunk in got.chunks if chunk] == [got.text]
    assert got.text == expected(pipeline, "Hello", [png(5, (96, 64))]).text


def test_concurrent_requests_get_their_own_answers(triton_server, pipeline) -> None:
    """Eight streams at once (postprocessing may merge tokens into fewer responses): each
    gets its own text and exact token counts."""
    cases = [(f"Question {i}: " + "what do you see? " * (i % 3),
              [png(10 + i, (64 + 32 * (i % 3), 64))] if i % 4 else [], 6 + i)
             for i in range(8)]
    answers = [expected(pipeline, p, imgs, max_tokens=n) for p, imgs, n in cases]
    wanted = [(a.text, *counts(pipeline, a)) for a in answers]
    assert len({w[0] for w in wanted}) > 1, "the cases should not all have the same answer"
    got: dict[int, tuple[str, int, int]] = {}
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(cases))

    def run(i: int) -> None:
        prompt, images, n = cases[i]
        barrier.wait()
        try:
            answer = grpc_ask(triton_server, prompt=prompt, images=images, max_tokens=n)
            got[i] = (answer.text, answer.prompt_tokens, answer.completion_tokens)
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures
    assert [got[i] for i in range(len(cases))] == wanted


def test_videos_over_grpc_stream_equal_the_reference_pipeline(triton_server, pipeline,
                                                              video_clip) -> None:
    """A video file in text_input's video_bytes (to the ensemble and to tensorrt_llm_bls), and
    in messages a video_url with the file as a data URI beside a frame list (the OpenAI
    gateway's format): the streamed text is the reference pipeline's."""
    from video_clips import data_uri as video_uri
    from video_clips import png_frames

    from qvl_trt.chat_messages import VideoFile, VideoFrames
    from qvl_trt.llm.pipeline import sampling_params

    greedy = sampling_params(pipeline.checkpoint.path, max_tokens=12, greedy=True)
    want = pipeline.ask("What happens?", [png(3)], sampling=greedy,
                        videos=[VideoFile(video_clip)])
    got = grpc_ask(triton_server, prompt="What happens?", images=[png(3)], videos=[video_clip])
    assert got.text == want.text and got.prompt_tokens == want.prompt_tokens
    bls = grpc_ask(triton_server, prompt="What happens?", images=[png(3)], videos=[video_clip],
                   model=c.TENSORRT_LLM_BLS)
    assert bls.text == want.text
    frames = png_frames(3, 64, 64, seed=4)
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_uri(video_clip, "video/mp4")}},
        {"type": "text", "text": "and"},
        {"type": "video", "video": [video_uri(f, "image/png") for f in frames], "fps": 1},
        {"type": "text", "text": "What changes?"}]}]
    want = pipeline.generate(messages, sampling=greedy,
                             videos=[VideoFile(video_clip), VideoFrames(frames, fps=1.0)])
    got = grpc_ask(triton_server, messages=messages)
    assert got.text == want.text and got.prompt_tokens == want.prompt_tokens


def test_a_repeated_clip_hits_the_vision_cache_group_by_group(triton_server,
                                                              video_clip) -> None:
    """Sampled at 2.5 fps (not the default, which other tests use): 7 frames, 4 temporal
    groups: 4 misses, then 4 hits."""
    def counts():
        return tuple(metric(triton_server, f"qvl_vision_cache_{k}_total")
                     for k in ("hits", "misses"))

    hits, misses = counts()
    grpc_ask(triton_server, prompt="First look.", videos=[video_clip], video_fps=2.5,
             max_tokens=2)
    assert counts() == (hits, misses + 4)
    grpc_ask(triton_server, prompt="Second look.", videos=[video_clip], video_fps=2.5,
             max_tokens=2)
    assert counts() == (hits + 4, misses + 4)


def test_repeated_image_hits_the_vision_cache(triton_server) -> None:
    image = png(42, (128, 96))
    hits, misses = (metric(triton_server, f"qvl_vision_cache_{k}_total")
                    for k in ("hits", "misses"))
    grpc_ask(triton_server, prompt="First look.", images=[image], max_tokens=2)
    assert metric(triton_server, "qvl_vision_cache_misses_total") == misses + 1
    grpc_ask(triton_server, prompt="Second look.", images=[image], max_tokens=2)
    assert metric(triton_server, "qvl_vision_cache_hits_total") == hits + 1
    assert metric(triton_server, "qvl_vision_cache_misses_total") == misses + 1


# ---- bad requests ---------------------------------------------------------------------------

def _oversized() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buf, "PNG")  # 81 M pixels, a few kB
    return buf.getvalue()


BAD_REQUESTS = {
    "corrupt image": (dict(prompt="Hi", images=[png(1)[:60]]), "corrupt"),
    "oversized image": (dict(prompt="Hi", images=[_oversized()]),
                        "exceeds the limit of 67108864 decoded pixels"),
    "too many images": (dict(prompt="Hi", images=[png(1), png(2), png(3)]),
                        "request has 3 images, the engine allows 2"),
    "prompt too long": (dict(prompt="word " * 900), "the engine allows 768"),
    "max_tokens 0": (dict(prompt="Hi", max_tokens=0), "max_tokens = 0 must be from 1 to"),
    "max_tokens above the limit": (dict(prompt="Hi", max_tokens=5000),
                                   "max_tokens = 5000 is above the limit"),
    "malformed messages": (dict(messages="not a list"), "messages must be a non-empty"),
    "remote image URL": (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]),
        "remote image URL on host 'example.com' refused"),
}


BAD_REQUESTS.update({
    "corrupt video": (dict(prompt="Hi", videos=[b"\x00\x00\x00\x18ftypmp42" + b"x" * 99]),
                      "video 1: video data (111 bytes) could not be read"),
    "video fps 0": (dict(prompt="Hi", videos=[b"clip"], video_fps=0.0),
                    "video_fps = 0.0 must be a finite number of frames per second above 0"),
    "video in an assistant message": (dict(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]),
        "message 2: videos go in user messages, not assistant"),
})


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error_and_the_server_keeps_serving(triton_server,
                                                                      case) -> None:
    kwargs, message = BAD_REQUESTS[case]
    with pytest.raises(RequestFailed) as failed:
        grpc_ask(triton_server, **kwargs)
    assert message in str(failed.value)
    assert "Traceback" not in str(failed.value)
    assert grpc_ask(triton_server, prompt="Still there?", max_tokens=2).completion_tokens >= 1


def test_malformed_json_over_http_is_refused_clearly(triton_server) -> None:
    with pytest.raises(RequestFailed, match="messages is not valid JSON"):
        http_ask(triton_server, {c.MESSAGES: "{oops", c.MAX_TOKENS: 4})


def test_stop_string_ends_the_answer_and_is_left_out(triton_server, pipeline) -> None:
    tokenizer = pipeline.preprocessor.prompts.tokenizer
    full = expected(pipeline, "What is in the picture?", [png(0)])
    stop_token = full.token_ids[1]
    stop = tokenizer.decode([stop_token])
    assert tokenizer.encode(stop, add_special_tokens=False) == [stop_token]
    cut = full.token_ids[: full.token_ids.index(stop_token) + 1]
    for stream in (True, False):
        got = grpc_ask(triton_server, prompt="What is in the picture?", images=[png(0)],
                       stop=[stop], stream=stream)
        # The text ends before the stop string (OpenAI's rule); its token still counts.
        assert got.text == tokenizer.decode(list(cut[:-1]), skip_special_tokens=True)
        assert got.completion_tokens == len(cut)


def test_a_request_of_several_batch_rows_is_refused(triton_server) -> None:
    value = np.array([[b"one"], [b"two"]], object)
    tensor = grpcclient.InferInput(c.TEXT_INPUT, list(value.shape), "BYTES")
    tensor.set_data_from_numpy(value)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    try:
        client.async_stream_infer(c.ENSEMBLE, [tensor])
        error = results.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "send one request per conversation" in str(error)


def test_two_builds_in_one_repository_are_served_side_by_side(tmp_path, tiny_build,
                                                             triton_profile, triton_server):
    """`qvl-trt repo --build a=B1 --build b=B2` of two checkpoints of different sizes, the
    second with INT8 weights (`build --weights int8`): one server keeps both resident, the
    client picks one by its ensemble name, and the OpenAI endpoint lists both and answers each
    as its ensemble does."""
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    pytest.importorskip("aiohttp", reason="the gateway needs aiohttp: pip install "
                        "'qvl-trt[gateway]'")
    from qvl_trt.build import BuildOptions, Stage, run_build
    from qvl_trt.dtypes import WeightOnly
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
    from qvl_trt.testing.tiny_checkpoint import TinyDims, write_tiny_checkpoint
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    # A wider, deeper language model than the session's (64 wide, 4 layers), its features
    # multiples of 64 as weight-only layers need.
    other = write_tiny_checkpoint(tmp_path / "other", seed=1,
                                  dims=TinyDims(text_hidden=128, text_layers=5,
                                                text_intermediate=192))
    run_build(BuildOptions(model=str(other), gpu=str(triton_profile), weights=WeightOnly.INT8),
              tmp_path / "other-build", only=(Stage.LLM_CHECKPOINT,))
    assert json.loads((tmp_path / "other-build" / "llm_checkpoint" / "config.json")
                      .read_text())["quantization"]["quant_algo"] == "W8A16"
    repo = write_repo([BuildInput(tiny_build, "a"), BuildInput(tmp_path / "other-build", "b")],
                      tmp_path / "repo", RepoOptions(flavor=Flavor.REFERENCE,
                                                     preprocessing_instances=1,
                                                     vision_cache_mib=16))
    question = {"prompt": "What is in this picture?", "images": [png(11)]}
    messages = [{"role": "user", "content": "Say something."}]
    with TritonServer(ServerOptions(repo.path, free_ports()), log_file=tmp_path / "server.log",
                      startup_timeout_s=180) as server:
        a = grpc_ask(server, model="a", **question)
        b = grpc_ask(server, model="b", **question)
        with pytest.raises(RequestFailed, match="ensemble"):
            grpc_ask(server, **question)  # no unnamed ensemble in a repository of two builds
        want = {m: grpc_ask(server, model=m, messages=messages, max_tokens=6).text
                for m in ("a", "b")}
        gateway = GatewayProcess(GatewayOptions(server.grpc_url, port=free_ports().http),
                                 log_file=tmp_path / "gateway.log")
        gateway.start()
        try:
            gateway.wait_ready()
            api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            assert sorted(m.id for m in api.models.list()) == ["a", "b"]
            for model in ("a", "b"):
                answer = api.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=6, temperature=0)
                assert answer.model == model
                assert answer.choices[0].message.content == want[model]
        finally:
            assert gateway.stop() == 0, (tmp_path / "gateway.log").read_text()
    assert a.text == grpc_ask(triton_server, **question).text  # build a: the session's model
    assert b.text != a.text  # build b: another checkpoint
    assert want["a"] != want["b"]


# ---- the checkpoint's own generation defaults: `qvl-trt generate` decodes as served ----------

PARITY_PROMPT = "Tell me a story."
PARITY_SEED = 3


def cli_generate(model: Path, build: Path, *options: str) -> str:
    """`qvl-trt generate` (the in-process reference) on the build's converted checkpoint."""
    from typer.testing import CliRunner

    from qvl_trt.cli import app

    result = CliRunner().invoke(app, [
        "generate", "--model", str(model), "--checkpoint", str(build / "llm_checkpoint"),
        "--prompt", PARITY_PROMPT, "--max-tokens", "16", "--seed", str(PARITY_SEED), "--json",
        *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["text"]


# The tiny checkpoint's generation_config values, passed explicitly: what `generate` did
# before it followed do_sample (it sampled with them whether or not do_sample was true).
SAMPLED = ("--temperature", "0.7", "--top-k", "20", "--top-p", "0.8")


def test_generate_and_the_server_agree_when_do_sample_is_true(tiny_ckpt, tiny_build,
                                                              triton_server) -> None:
    """The tiny checkpoint has do_sample true (temperature 0.7, top_k 20, top_p 0.8): a
    seeded request that leaves its settings out samples alike on both sides."""
    assert json.loads((tiny_ckpt / "generation_config.json").read_text())["do_sample"] is True
    served = grpc_ask(triton_server, prompt=PARITY_PROMPT, max_tokens=16, temperature=None,
                      seed=PARITY_SEED).text
    assert cli_generate(tiny_ckpt, tiny_build) == served
    # Not greedy: a pipeline that ignored do_sample: true would fail the line above.
    assert cli_generate(tiny_ckpt, tiny_build, "--greedy") != served


def test_generate_and_the_server_agree_when_do_sample_is_unset(tmp_path, tiny_ckpt,
                                                               triton_profile) -> None:
    """The same weights with do_sample left out of generation_config.json (transformers then
    decodes greedily, temperature/top_k/top_p notwithstanding): both sides decode greedily,
    and the text differs from sampling with the file's values (the old `generate`)."""
    from qvl_trt.build import BuildOptions, Stage, run_build
    from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
    from qvl_trt.triton.model_configs import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    model = tmp_path / "unset"
    shutil.copytree(tiny_ckpt, model)
    config = json.loads((model / "generation_config.json").read_text())
    del config["do_sample"]
    (model / "generation_config.json").write_text(json.dumps(config))
    build = tmp_path / "build"
    run_build(BuildOptions(model=str(model), gpu=str(triton_profile)), build,
              only=(Stage.LLM_CHECKPOINT,))
    repo = write_repo([BuildInput(build)], tmp_path / "repo", RepoOptions(
        flavor=Flavor.REFERENCE, preprocessing_instances=1, vision_cache_mib=16))
    with TritonServer(ServerOptions(repo.path, free_ports()), log_file=tmp_path / "server.log",
                      startup_timeout_s=180) as server:
        served = grpc_ask(server, prompt=PARITY_PROMPT, max_tokens=16, temperature=None,
                          seed=PARITY_SEED).text
    assert cli_generate(model, build) == served
    assert cli_generate(model, build, "--greedy") == served
    assert cli_generate(model, build, *SAMPLED) != served


# ---- what the served API refuses and accepts (docs/triton.md, "Ensemble API") ------------

def http_generate(server, body: dict, model: str = c.ENSEMBLE) -> tuple[int, dict]:
    """One request over plain HTTP /generate: (status, JSON body)."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_plain_generate_answers_when_stream_is_false(triton_server) -> None:
    body = {c.TEXT_INPUT: "Hello", c.MAX_TOKENS: 6, c.TEMPERATURE: 0.0}
    status, reply = http_generate(triton_server, {**body, c.STREAM: False})
    assert status == 200, reply
    assert reply[c.TEXT_OUTPUT] == grpc_ask(triton_server, prompt="Hello", max_tokens=6).text
    assert reply[c.COMPLETION_TOKENS] == 6
    # stream=true makes several responses, which /generate refuses (Triton 2.51 says so in
    # a 200 reply's error field).
    status, reply = http_generate(triton_server, {**body, c.STREAM: True})
    assert status == 200
    assert "generate expects model to produce exactly 1 response" in reply["error"]


def test_an_internal_model_answers_a_client_directly(triton_server) -> None:
    """Triton has no per-model access control, so a step of the pipeline serves whoever
    calls it: docs/triton.md says to filter model names at the network edge."""
    body = {"inputs": [{"name": c.TEXT_INPUT, "shape": [1, 1], "datatype": "BYTES",
                        "data": ["Hi"]}], "outputs": [{"name": c.INPUT_LENGTHS}]}
    request = urllib.request.Request(
        f"http://{triton_server.http_url}/v2/models/{c.PREPROCESSING}/infer",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    assert reply["outputs"][0]["name"] == c.INPUT_LENGTHS and reply["outputs"][0]["data"][0] > 0


def test_an_oversized_stop_list_is_refused_before_generation(triton_server) -> None:
    """100,000 stop strings: refused by preprocessing, naming the bound, before
    the decoder makes a token; the server keeps serving."""
    steps = iterations(triton_server)
    with pytest.raises(RequestFailed) as refused:
        grpc_ask(triton_server, prompt="Hi", max_tokens=64, stop=["x"] * 100_000)
    assert "the number of stop strings is 100000, above the limit of 16" in str(refused.value)
    assert "max_stop_words" in str(refused.value)
    assert iterations(triton_server) == steps
    assert grpc_ask(triton_server, prompt="Still there?", max_tokens=2).completion_tokens == 2


def llm_answer(server, input_ids, output_len: int, **extra: np.ndarray) -> list[int]:
    """One text-only request straight to tensorrt_llm in the stock backend's tensors (as
    `qvl-trt verify` sends them, MRoPE table at identity positions): its token ids; a
    refusal raises RequestError with the model's message."""
    from qvl_trt.client.verify import StepwiseDeployment

    deployment = StepwiseDeployment(f"grpc://{server.grpc_url}")
    try:
        n = len(input_ids)
        values = {c.INPUT_IDS: np.array([input_ids], np.int32),
                  c.INPUT_LENGTHS: np.array([[n]], np.int32),
                  c.REQUEST_OUTPUT_LEN: np.array([[output_len]], np.int32),
                  c.STREAMING: np.array([[True]]),
                  c.MROPE_ROTARY_COS_SIN: deployment.mrope(np.tile(np.arange(n), (3, 1)))[None],
                  c.MROPE_POSITION_DELTAS: np.array([[0]], np.int64), **extra}
        return deployment._generate(deployment.llm_model,
                                    deployment._inputs({k: k for k in values}, values))
    finally:
        deployment.close()


def test_tensorrt_llm_applies_the_executors_rules(triton_server) -> None:
    """Called directly, the reference tensorrt_llm refuses what the TensorRT-LLM executor
    refuses (a prompt above its maximum input length, max_seq_len - 1 with chunked context;
    a malformed stop_words_list) with an error response, clips what it clips (an output
    length past max_seq_len), and keeps serving."""
    from qvl_trt.errors import RequestError

    positions = LIMITS["max_seq_len"]  # the tiny build's
    with pytest.raises(RequestError, match=rf"Prompt length \({positions}\) exceeds maximum "
                       rf"input length \({positions - 1}\)"):
        llm_answer(triton_server, [100] * positions, 2)
    with pytest.raises(RequestError, match=re.escape("offsets [2, 1, -1] do not increase")):
        llm_answer(triton_server, [100, 101], 2,
                   **{c.STOP_WORDS_LIST: np.array([[[5, 6, 7], [2, 1, -1]]], np.int32)})
    assert len(llm_answer(triton_server, [100] * (positions - 3), 10)) == 3
    assert len(llm_answer(triton_server, [100, 101], 2)) == 2


def test_tensorrt_llm_publishes_the_stock_backends_metrics_and_no_others(triton_server) -> None:
    """The reference tensorrt_llm's metrics are the stock backend's (names, labels, meaning:
    triton/tensorrtllm_backend.py), so that what serve reads as progress holds on the trt
    flavor too; a metric the stock backend lacks would let a check pass here only."""
    from qvl_trt.triton import tensorrtllm_backend as tb

    before = iterations(triton_server)
    grpc_ask(triton_server, prompt="Count.", max_tokens=3)
    samples = samples_at(triton_server.metrics_url)
    ours = {(name, labels) for name, labels in samples
            if dict(labels).get("model") == c.TENSORRT_LLM
            and not name.startswith("nv_inference_")}  # Triton's own, for every model
    stock = {g.family: g for g in (tb.REQUEST_METRICS, tb.KV_CACHE_METRICS,
                                   tb.INFLIGHT_BATCHER_METRICS, tb.GENERAL_METRICS,
                                   tb.OUTPUT_TOKEN_LEN, tb.INPUT_TOKEN_LEN)}
    families = {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                for name, _ in ours}
    assert families <= stock.keys(), families - stock.keys()
    for group in (tb.REQUEST_METRICS, tb.KV_CACHE_METRICS, tb.INFLIGHT_BATCHER_METRICS,
                  tb.GENERAL_METRICS):
        for series in group.series:
            labels = frozenset({"model": c.TENSORRT_LLM, "version": "1",
                                group.category: series}.items())
            assert (group.family, labels) in ours, (group.family, series)
    assert iterations(triton_server) >= before + 3  # one iteration a token
    assert samples["nv_trt_llm_request_metrics", frozenset(
        {"model": c.TENSORRT_LLM, "version": "1", "request_type": "max"}.items())] == 8
