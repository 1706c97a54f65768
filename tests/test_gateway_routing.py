"""Two builds of one checkpoint behind one OpenAI model: `qvl-trt repo` names them one model
(triton/repository.py `_served_names`), and the gateway sends each request to the build that
fits it (gateway/routing.py). The choice itself on hand-made limits; then the session's chat
build of the tiny checkpoint beside a video build of it (lower batch, larger limits), served
by a real tritonserver and gateway, asked with the openai package: where each request ran is
read from Triton's own per-model request counters. The clip the video workload is sized for
(30 frames of 1280x720), as an encoded file, runs on the video build unscaled, through chunked
context; the chat build takes it scaled down."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest
from test_serve_server import data_uri, grpc_ask, png, samples_at

from qvl_trt.errors import ConfigError
from qvl_trt.gateway import routing
from qvl_trt.gateway.upstream import Build, ServedModel, served_models
from qvl_trt.triton import contract as c

CHECKPOINT = "ckpt"  # the test checkpoint folder's name (conftest.tiny_ckpt): the group's name


# ---- the choice, on hand-made limits ----------------------------------------------------------

def limits(**fields) -> c.PreprocessingParameters:
    base = dict(max_images=2, max_input_len=768, max_seq_len=1024, min_pixels=4096,
                max_pixels=65536, max_visual_tokens=128, default_max_tokens=64,
                max_request_bytes=2**20, max_messages=8, max_content_parts=8,
                max_text_bytes=2**16, max_stop_words=4, max_stop_bytes=64, max_stop_tokens=64,
                max_videos=2, max_video_frames=16, max_video_seconds=60.0,
                max_video_frame_pixels=0, max_video_tokens=128, checkpoint_name="ckpt",
                served_name="ckpt")
    return c.PreprocessingParameters(**{**base, **fields})


def build(name: str, capacity: int, **fields) -> Build:
    return Build(name, c.ModelNames.for_build(name), limits(**fields), capacity, capacity // 2)


CHAT = build("chat", 40, max_videos=0)
VIDEO = build("video", 10, max_input_len=1536, max_seq_len=2048, max_visual_tokens=512,
              max_video_tokens=512)
LONG = build("long", 5, max_input_len=8192, max_seq_len=16384, max_visual_tokens=512,
             max_video_tokens=256, max_images=4)


def test_the_builds_of_a_served_name_are_one_model_and_the_rest_stand_alone() -> None:
    alone = build("other", 8, served_name="", checkpoint_name="other-ckpt")
    served = served_models([CHAT, VIDEO, alone])
    assert {n: m.builds for n, m in served.items()} == {"ckpt": (CHAT, VIDEO), "other": (alone,)}
    assert (served["ckpt"].capacity, served["ckpt"].root) == (50, "ckpt")


def test_text_goes_to_the_higher_batch_build_and_a_video_to_the_video_build() -> None:
    pair = ServedModel("ckpt", (CHAT, VIDEO))
    assert routing.choose(pair, images=2, videos=0) is CHAT
    assert routing.choose(pair, images=0, videos=1) is VIDEO  # video is off in the chat build
    # With video on in both, still the build with the larger video budget: the chat build
    # would scale the clip down to its own rather than refuse it.
    both = ServedModel("ckpt", (dataclasses.replace(CHAT, limits=limits()), VIDEO))
    assert routing.choose(both, images=0, videos=1) is VIDEO
    trio = ServedModel("ckpt", (CHAT, VIDEO, LONG))
    assert routing.choose(trio, images=3, videos=0) is LONG  # only it takes 3 images
    assert routing.choose(trio, images=0, videos=1) is VIDEO
    # None takes 5 images: the one that comes closest answers, naming its limit.
    assert routing.choose(trio, images=5, videos=0) is LONG


def test_a_refusal_for_size_goes_on_once_to_the_largest_build_above() -> None:
    trio = ServedModel("ckpt", (CHAT, VIDEO, LONG))
    assert routing.larger(trio, CHAT, images=0, videos=0) is LONG
    assert routing.larger(ServedModel("ckpt", (CHAT, VIDEO)), CHAT, 0, 0) is VIDEO
    # LONG's video budget is below VIDEO's: not larger in every limit, so no second try.
    assert routing.larger(trio, VIDEO, images=0, videos=1) is None
    assert routing.larger(trio, LONG, images=0, videos=0) is None
    # A build that does not take the request's videos is not tried.
    assert routing.larger(ServedModel("ckpt", (VIDEO, CHAT)), VIDEO, 0, 1) is None


# ---- which builds the repository serves as one model ------------------------------------------

def test_the_repository_names_one_model_per_checkpoint_of_several_workloads(tmp_path) -> None:
    from qvl_trt.manifest import BuildFolder, BuildOptions, Manifest
    from qvl_trt.triton.repository import _Build, _served_names

    def made(name: str, hashes: dict, workload: str | None = None,
             folder: str = "Qwen3-VL-2B-Instruct") -> _Build:
        options = BuildOptions(folder, "4090d", workload=workload or "chat")
        checkpoint = type("Checkpoint", (), {"path": tmp_path / folder})()
        return _Build(BuildFolder(tmp_path / name), Manifest(options=options,
                                                             inputs={"checkpoint": hashes}),
                      checkpoint, None, None)

    a, b = {"model.safetensors": "aa"}, {"model.safetensors": "bb"}

    def served(*builds: _Build) -> list[str]:
        names = [c.ModelNames.for_build(f"b{i}") for i in range(len(builds))]
        return _served_names(builds, names)

    assert served(made("chat", a), made("video", a, "video")) == ["Qwen3-VL-2B-Instruct"] * 2
    # Another checkpoint (other hashes, whatever its folder's name) is never in the group.
    assert served(made("chat", a), made("video", a, "video"),
                  made("other", b, "video", folder="Qwen3-VL-2B-Instruct-2")) == \
        ["Qwen3-VL-2B-Instruct", "Qwen3-VL-2B-Instruct", ""]
    # One checkpoint's builds of one workload (FP16 beside INT8, say) are served apart.
    assert served(made("fp16", a), made("int8", a)) == ["", ""]
    with pytest.raises(ConfigError, match="b0 and b2 are both chat builds of "
                       "Qwen3-VL-2B-Instruct.*leave one out"):
        served(made("chat", a), made("video", a, "video"), made("int8", a))
    with pytest.raises(ConfigError, match="served as the model 'Qwen3-VL-2B-Instruct', the "
                       "name of another build or checkpoint too"):
        served(made("chat", a), made("video", a, "video"), made("chat2", b),
               made("long", b, "long"))


# ---- served: a chat and a video build of the tiny checkpoint ----------------------------------

# The video build: a quarter of the batch; its workload raises the prompt, the visual cap and
# the frames to the checkpoint's clip budget. 32 frames take the 30-frame clip (the shipped
# profiles take 64).
VIDEO_LIMITS = {"max_batch_size": 2, "max_input_len": 1536, "max_seq_len": 2048,
                "max_num_tokens": 2048, "max_visual_tokens_per_request": 512,
                "video_max_tokens": 512, "video_max_frames": 32}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path, tiny_build: Path):
    """(server, gateway): the session's build (chat) and a video build of the same
    checkpoint in one reference repository, served by a real tritonserver and gateway."""
    pytest.importorskip("openai", reason="the tests use the openai package as the client")
    pytest.importorskip("aiohttp", reason="the gateway needs aiohttp: pip install "
                        "'qvl-trt[gateway]'")
    from qvl_trt.build import BuildOptions, Stage, run_build
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
    from qvl_trt.testing.small_profile import small_profile_toml
    from qvl_trt.triton.options import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo
    from qvl_trt.workload import Workload

    root = tmp_path_factory.mktemp("routing")
    profile = root / "video.toml"
    profile.write_text(small_profile_toml(**VIDEO_LIMITS))
    video = root / "video-build"
    run_build(BuildOptions(model=str(tiny_ckpt), gpu=str(profile), workload=Workload.VIDEO),
              video, only=(Stage.LLM_CHECKPOINT,))
    repo = write_repo([BuildInput(tiny_build, "chat"), BuildInput(video, "video")],
                      root / "repo", RepoOptions(flavor=Flavor.REFERENCE,
                                                 preprocessing_instances=1,
                                                 postprocessing_instances=1,
                                                 vision_cache_mib=16))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TritonServer(ServerOptions(repo.path, free_ports()),
                                                  log_file=root / "server.log",
                                                  startup_timeout_s=180))
        gateway = stack.enter_context(GatewayProcess(
            GatewayOptions(server.grpc_url, port=free_ports().http),
            log_file=root / "gateway.log"))
        gateway.wait_ready()
        yield server, gateway
        assert gateway.stop() == 0, (root / "gateway.log").read_text()


def ran(server) -> dict[str, float]:
    """Requests each build's preprocessing and tensorrt_llm took (answered or refused), by
    Triton's per-model counters."""
    from qvl_trt.serve.progress import total

    samples = samples_at(server.metrics_url)
    return {model: sum(total(samples, counter, model=model) for counter in (
        "nv_inference_request_success", "nv_inference_request_failure"))
        for model in (f"{b}_{step}" for b in ("chat", "video")
                      for step in (c.PREPROCESSING, c.TENSORRT_LLM))}


def gateway_counts(gateway) -> tuple[float, float]:
    """(requests the gateway sent on to a larger build, 400s the video build gave)."""
    from qvl_trt.serve.progress import total

    samples = samples_at(f"{gateway.url}/metrics")
    return (total(samples, "qvl_gateway_rerouted_total", model=CHECKPOINT, build="chat"),
            total(samples, "qvl_gateway_requests_total", model=CHECKPOINT, build="video",
                  status="400"))


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def api(gateway):
    import openai

    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def long_text(tokens: int) -> str:
    return "word " * tokens


def _video_limits(tiny_ckpt: Path, tmp_path: Path):
    """The limits the planner derives for the video build (its workload raises the profile's
    to the checkpoint's clip budget)."""
    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.plan import make_plan
    from qvl_trt.profiles import load_profile
    from qvl_trt.testing.small_profile import small_profile_toml
    from qvl_trt.workload import Workload

    path = tmp_path / "video.toml"
    path.write_text(small_profile_toml(**VIDEO_LIMITS))
    return make_plan(open_checkpoint(tiny_ckpt), load_profile(str(path)),
                     workload=Workload.VIDEO).limits


def test_models_list_one_name_for_the_pair_with_what_it_admits(pair, tiny_ckpt,
                                                               tmp_path) -> None:
    _, gateway = pair
    lim = _video_limits(tiny_ckpt, tmp_path)
    client = api(gateway)
    assert [m.id for m in client.models.list()] == [CHECKPOINT]
    card = json.loads(urllib.request.urlopen(f"{gateway.url}/v1/models/{CHECKPOINT}",
                                             timeout=10).read())
    # The largest of each build's: the video build's prompt and context, both builds' images.
    assert (card["builds"], card["max_model_len"], card["limits"]) == (
        ["chat", "video"], lim.max_seq_len, {
            "max_input_len": lim.max_input_len, "max_images": 2, "max_videos": 2,
            "max_visual_tokens": lim.max_visual_tokens_per_request})
    assert gateway.readiness() == (True, "ready")


def test_each_request_runs_on_the_build_that_fits_it(pair) -> None:
    from video_clips import data_uri as video_uri
    from video_clips import video_file

    server, gateway = pair
    client = api(gateway)

    def ask(content, **settings) -> tuple[dict[str, float], object]:
        before = ran(server)
        answer = client.chat.completions.create(
            model=CHECKPOINT, messages=[{"role": "user", "content": content}],
            max_tokens=2, temperature=0, **settings)
        return grown(before, ran(server)), answer

    image = [{"type": "image_url", "image_url": {"url": data_uri(png(4))}},
             {"type": "text", "text": "What is in the picture?"}]
    where, answer = ask(image)
    assert where == {"chat_preprocessing": 1, "chat_tensorrt_llm": 1}
    assert answer.model == CHECKPOINT
    assert answer.choices[0].message.content == grpc_ask(
        server, model="chat", messages=[{"role": "user", "content": image}], max_tokens=2).text

    clip = [{"type": "video_url", "video_url": {"url": video_uri(video_file(30, 96, 64),
                                                                 "video/mp4")}},
            {"type": "text", "text": "What happens?"}]
    where, _ = ask(clip)
    assert where == {"video_preprocessing": 1, "video_tensorrt_llm": 1}

    # 1000 tokens: above the chat build's 768, which refuses it in preprocessing; the video
    # build answers, streamed too (nothing had gone to the client).
    where, answer = ask(long_text(1000))
    assert where == {"chat_preprocessing": 1, "video_preprocessing": 1,
                     "video_tensorrt_llm": 1}
    assert answer.usage.prompt_tokens > 1000
    before = ran(server)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions
                   .create(model=CHECKPOINT, messages=[{"role": "user",
                                                        "content": long_text(1000)}],
                           max_tokens=2, temperature=0, stream=True) if chunk.choices)
    assert text == answer.choices[0].message.content
    assert grown(before, ran(server)) == where

    # A build of the pair by its own name: that build alone.
    before = ran(server)
    client.chat.completions.create(model="video", messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2)
    assert grown(before, ran(server)) == {"video_preprocessing": 1, "video_tensorrt_llm": 1}


def test_the_video_build_serves_the_full_size_clip_whole(pair, tiny_ckpt, tmp_path) -> None:
    # 30 frames of 1280x720 sent as JPEG frames (at the default 2 fps), as a client sends a
    # sampled clip: the video build takes them at the size its processor gives them, 15
    # groups of 20 x 36 merged tokens (frames 640x1152), prefilled in chunks of max_num_tokens.
    import base64
    import io

    from PIL import Image
    from video_clips import frame_pixels

    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.plan import make_plan
    from qvl_trt.profiles import load_profile
    from qvl_trt.workload import Workload

    lim = _video_limits(tiny_ckpt, tmp_path)
    clip = make_plan(open_checkpoint(tiny_ckpt), load_profile(str(tmp_path / "video.toml")),
                     workload=Workload.VIDEO).typical_video
    assert clip.visual_tokens == 15 * 20 * 36 == 10800 and not clip.refused
    assert clip.visual_tokens > lim.max_num_tokens
    frames = []
    for i in range(30):
        buffer = io.BytesIO()
        Image.fromarray(frame_pixels(i, 1280, 720)).save(buffer, "JPEG", quality=90)
        frames.append(base64.b64encode(buffer.getvalue()).decode())
    server, gateway = pair
    client = api(gateway)
    question = {"type": "text", "text": "What happens?"}

    def prompt_tokens(content) -> tuple[dict[str, float], int]:
        before = ran(server)
        answer = client.chat.completions.create(
            model=CHECKPOINT, messages=[{"role": "user", "content": content}], max_tokens=2,
            temperature=0)
        assert answer.choices[0].finish_reason == "length"
        return grown(before, ran(server)), answer.usage.prompt_tokens

    where, with_clip = prompt_tokens([{"type": "video_url", "video_url": {
        "url": "data:video/jpeg;base64," + ",".join(frames)}}, question])
    assert where == {"video_preprocessing": 1, "video_tensorrt_llm": 1}
    _, text_only = prompt_tokens([question])
    # Unscaled: every visual token of the clip, beside at most 9 text tokens per group
    # ("<12.5 seconds>" and the vision start and end).
    assert clip.visual_tokens <= with_clip - text_only <= clip.visual_tokens + 15 * 9


def preprocessed(server, build: str, messages: list[dict]) -> tuple[list[list[int]], int]:
    """What a build's preprocessing, asked directly, makes of a request: its vision items'
    patch grids (a video's temporal groups, (1, h, w) each) and the prompt's tokens."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    value = np.array([[json.dumps(messages).encode()]], object)
    tensor = grpcclient.InferInput(c.MESSAGES, list(value.shape), "BYTES")
    tensor.set_data_from_numpy(value)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer(c.ModelNames.for_build(build).preprocessing, [tensor], outputs=[
            grpcclient.InferRequestedOutput(name) for name in (c.IMAGE_GRID_THW,
                                                               c.INPUT_LENGTHS)])
    finally:
        client.close()
    return (result.as_numpy(c.IMAGE_GRID_THW).reshape(-1, 3).tolist(),
            int(result.as_numpy(c.INPUT_LENGTHS).reshape(-1)[0]))


def test_an_encoded_full_size_clip_runs_unscaled_on_the_video_build_and_scaled_on_chat(
        pair, tiny_ckpt, triton_profile, tmp_path) -> None:
    # The clip the planner sizes the video workload for, as a client uploads it: an MP4 of 30
    # frames of 1280x720, 15 s at 2 fps, so the default sampling (2 fps) keeps every frame.
    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    from video_clips import data_uri as video_uri
    from video_clips import video_file

    from qvl_trt.checkpoint import open_checkpoint
    from qvl_trt.manifest import BUILD_CONFIG_NAME
    from qvl_trt.plan import make_plan
    from qvl_trt.profiles import load_profile
    from qvl_trt.triton import tensorrtllm_backend as tb
    from qvl_trt.triton.layout import VERSION
    from qvl_trt.triton.pbconfig import parameters, read_config
    from qvl_trt.workload import Workload

    server, gateway = pair
    lim = _video_limits(tiny_ckpt, tmp_path)
    promised = make_plan(open_checkpoint(tiny_ckpt), load_profile(str(tmp_path / "video.toml")),
                         workload=Workload.VIDEO).typical_video
    chat = make_plan(open_checkpoint(tiny_ckpt), load_profile(str(triton_profile))).limits
    # The clip budget is the checkpoint's (the released video processor's 25165824 pixels).
    assert lim.video_max_tokens == lim.max_visual_tokens_per_request == 12288
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_uri(
            video_file(30, 1280, 720, rate=2, quick=True), "video/mp4")}},
        {"type": "text", "text": "What happens?"}]}]

    # Unscaled: each frame at the processor's cap of 786432 pixels, 640x1152 (the grid
    # transformers' Qwen3-VL video processor gives this clip, tests/test_mm_video_hf.py): 15
    # temporal groups of 40x72 patches, 20x36 merged tokens each. The counters are read before
    # the direct call: Triton counts a request after its response, so a read between the two
    # calls could miss it.
    before = ran(server)
    grid, prompt_tokens = preprocessed(server, "video", messages)
    assert grid == [[1, 40, 72]] * 15
    assert sum(t * h * w for t, h, w in grid) // 4 == promised.visual_tokens == 10800
    assert not promised.refused

    # The answer through the gateway: the video build's, with every one of those tokens.
    client = api(gateway)
    answer = client.chat.completions.create(model=CHECKPOINT, messages=messages, max_tokens=2,
                                            temperature=0)
    # Preprocessing twice: the direct call and the gateway's request.
    assert grown(before, ran(server)) == {"video_preprocessing": 2, "video_tensorrt_llm": 1}
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2
    assert answer.usage.prompt_tokens == prompt_tokens > promised.visual_tokens
    # Longer than the engine's max_num_tokens: the executor takes such a prompt only with
    # chunked context (else it refuses above min(max_seq_len - 1, max_num_tokens)), which the
    # repository turns on and the engine (paged context FMHA) keeps.
    folder = server.opts.repo / c.ModelNames.for_build("video").tensorrt_llm
    engine = tb.EngineLimits.of_build_config(
        json.loads((folder / VERSION / BUILD_CONFIG_NAME).read_text()))
    assert parameters(read_config(folder))["enable_chunked_context"] == "true"
    assert engine.chunked(True) and engine.max_num_tokens == lim.max_num_tokens
    assert engine.max_input_len(False) < prompt_tokens <= engine.max_input_len(True)

    # The chat build, asked by its own name, takes the clip scaled down to its own budget (a
    # file is sampled down to its video_max_frames, the frames shrunk into video_max_tokens;
    # docs/build.md "GPU profiles") rather than refusing it: here 16 frames, 8 groups of 6x10
    # patches (frames 96x160), 120 of its 128 tokens.
    before = ran(server)
    grid, prompt_tokens = preprocessed(server, "chat", messages)
    assert grid == [[1, 6, 10]] * (chat.video_max_frames // 2)
    assert sum(t * h * w for t, h, w in grid) // 4 <= chat.video_max_tokens
    answer = client.chat.completions.create(model="chat", messages=messages, max_tokens=2,
                                            temperature=0)
    assert grown(before, ran(server)) == {"chat_preprocessing": 2, "chat_tensorrt_llm": 1}
    assert answer.usage.prompt_tokens == prompt_tokens <= chat.max_input_len


def test_a_request_neither_build_takes_is_a_400_naming_the_limit(pair, tiny_ckpt,
                                                                 tmp_path) -> None:
    import openai

    server, gateway = pair
    longest = _video_limits(tiny_ckpt, tmp_path).max_input_len
    client = api(gateway)
    counted = gateway_counts(gateway)
    before = ran(server)
    with pytest.raises(openai.BadRequestError,
                       match=f"the engine allows {longest}: shorten the text"):
        client.chat.completions.create(model=CHECKPOINT, max_tokens=2, messages=[
            {"role": "user", "content": long_text(longest + 500)}])
    # Tried on the chat build, then once on the video build; neither generated.
    assert grown(before, ran(server)) == {"chat_preprocessing": 1, "video_preprocessing": 1}
    # Three images: neither build takes them, so one try, on the one with the most room.
    before = ran(server)
    with pytest.raises(openai.BadRequestError, match="request has 3 images, the engine allows 2"):
        client.chat.completions.create(model=CHECKPOINT, max_tokens=2, messages=[
            {"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": data_uri(png(i))}}
                  for i in range(3)), {"type": "text", "text": "Compare."}]}])
    assert grown(before, ran(server)) == {"video_preprocessing": 1}
    # The gateway's metrics: one request sent on from the chat build; both refused by the
    # video build (the build asked last labels a request).
    assert [a - b for a, b in zip(gateway_counts(gateway), counted, strict=True)] == [1, 2]


def test_detail_low_and_high_cost_what_docs_say_on_a_build_whose_maximum_is_above_low(
        pair, tiny_ckpt, tmp_path) -> None:
    """The 1920x1080 photo of docs/openai.md's table on the video build, whose images may
    reach 786432 pixels: detail low costs the few tokens of LOW_DETAIL_MAX_PIXELS, high (and
    no detail) the build's maximum, each in usage.prompt_tokens_details."""
    from test_gateway_app import photo_question

    from qvl_trt.mm.geometry import LOW_DETAIL_MAX_PIXELS, image_token_count

    lim = _video_limits(tiny_ckpt, tmp_path)
    assert lim.vision_max_pixels > LOW_DETAIL_MAX_PIXELS
    server, gateway = pair
    client = api(gateway)
    tokens = {}
    for detail in ("low", "high", None):
        before = ran(server)
        answer = client.chat.completions.create(
            model="video", messages=photo_question(**({"detail": detail} if detail else {})),
            max_tokens=2, temperature=0)
        assert grown(before, ran(server)) == {"video_preprocessing": 1, "video_tensorrt_llm": 1}
        details = answer.usage.prompt_tokens_details
        tokens[detail] = (details.image_tokens, details.video_tokens)
    low = image_token_count(1080, 1920, min_pixels=lim.vision_min_pixels,
                            max_pixels=LOW_DETAIL_MAX_PIXELS)
    high = image_token_count(1080, 1920, min_pixels=lim.vision_min_pixels,
                             max_pixels=lim.vision_max_pixels)
    assert tokens == {"low": (low, 0), "high": (high, 0), None: (high, 0)}
    assert (low, high) == (252, 720)  # 384x672 (docs/openai.md), 640x1152
