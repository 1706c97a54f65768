"""Pieces of the Triton repository that need no server: incremental detokenization, request
parsing, word lists, the vision cache, config protobufs and the server command lines."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import numpy as np
import pytest

from qvl_trt.errors import ConfigError, InputError
from qvl_trt.generation_config import SamplingDefaults
from qvl_trt.machine import TritonInstall
from qvl_trt.triton import contract as c
from qvl_trt.triton.runtime.request_inputs import UrlPolicy, chat_request
from qvl_trt.triton.runtime.vision_cache import RowCache
from qvl_trt.triton.server import Ports, ServerOptions, format_command, server_command


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_ckpt: Path) -> Path:
    return tiny_ckpt


# ---- detokenization -------------------------------------------------------------------------

def test_streamed_deltas_concatenate_to_the_one_shot_decode(tokenizer_dir: Path) -> None:
    """Token by token, including characters split over byte tokens, invalid byte runs,
    special tokens and ids beyond the vocabulary: the deltas add up to HF's decode."""
    tokenizers = pytest.importorskip("tokenizers")
    from qvl_trt.mm.detokenizer import StreamDecoder, TokenBytes

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    table = TokenBytes.from_tokenizer_json(tokenizer_dir / "tokenizer.json")
    rng = random.Random(0)
    text = "Größe 你好，世界 🙂🦜 <think>x</think>"
    split = tok.encode(text).ids
    assert len(split) > len(text.split()), "expected characters split over several tokens"
    cases = [split, split + [151645], [rng.randrange(151_936) for _ in range(40)]]
    cases += [[rng.randrange(151_936) for _ in range(rng.randrange(1, 20))] for _ in range(200)]
    for ids in cases:
        stream = StreamDecoder(table)
        deltas = [stream.push([t]) for t in ids] + [stream.push([], final=True)]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert stream.tokens == len(ids)
    # A split character shows nowhere half-done: no delta holds a replacement character.
    stream = StreamDecoder(table)
    assert all("\ufffd" not in stream.push([t]) for t in split)


# ---- request parsing ------------------------------------------------------------------------

def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _parse(**inputs):
    return chat_request(inputs, urls=UrlPolicy(), defaults=SamplingDefaults())


def test_messages_with_data_uri_images_and_the_text_form_agree() -> None:
    png = _png()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "What is it?"}]}]
    a = _parse(messages=json.dumps(messages).encode(), max_tokens=np.int32(5))
    b = _parse(text_input=b"What is it?", image_bytes=np.array([png], object),
               max_tokens=np.int32(5))
    assert a.images == b.images == (png,)
    assert a.settings == b.settings
    c_ = _parse(text_input=b"What is it?", image_bytes=np.array([uri.encode()], object))
    assert c_.images == (png,)


@pytest.mark.parametrize("inputs, message", [
    ({"messages": b"{not json"}, "messages is not valid JSON"),
    ({"messages": b"[]"}, "non-empty JSON list"),
    ({}, "neither messages nor text_input"),
    ({"text_input": b"hi", "max_tokens": np.int32(0)}, "max_tokens = 0 must be at least 1"),
    ({"text_input": b"hi", "temperature": np.float32(-1)}, "temperature = -1.0 must be >= 0"),
    ({"text_input": b"hi", "top_p": np.float32(0)}, "top_p = 0.0 must be in (0, 1]"),
    ({"text_input": b"\xff"}, "text_input is not UTF-8"),
    ({"text_input": b"hi", "image_bytes": np.array([b"data:image/png;base64,@@"], object)},
     "invalid base64"),
    ({"text_input": b"hi", "image_bytes": np.array([b"https://example.com/a.png"], object)},
     "remote image URL on host 'example.com' refused"),
])
def test_bad_inputs_give_one_line_errors(inputs, message) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        _parse(**inputs)


def test_remote_images_come_only_from_allowed_hosts(tmp_path) -> None:
    """A real fetch from a local HTTP server whose host is on the allow-list; the same URL is
    refused without it, and a file larger than the limit is refused."""
    import functools
    import http.server
    import threading

    png = _png()
    (tmp_path / "cat.png").write_bytes(png)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        messages = json.dumps([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]).encode()
        allowed = UrlPolicy.from_parameter("example.com, 127.0.0.1")
        request = chat_request({"messages": messages}, urls=allowed, defaults=SamplingDefaults())
        assert request.images == (png,)
        with pytest.raises(InputError, match="host '127.0.0.1' refused"):
            _parse(messages=messages)
        small = UrlPolicy(frozenset({"127.0.0.1"}), max_bytes=len(png) - 1)
        with pytest.raises(InputError, match="exceeds"):
            chat_request({"messages": messages}, urls=small, defaults=SamplingDefaults())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_greedy_and_defaults() -> None:
    """A request without settings gets the defaults; the checkpoint's defaults
    (GenerationConfig.sampling_defaults) are tested in test_generation_config.py."""
    settings = _parse(text_input=b"x").settings
    assert (settings.temperature, settings.top_k, settings.stream) == (1.0, 0, False)
    greedy = chat_request({"text_input": b"x", "top_k": 5}, urls=UrlPolicy(),
                          defaults=SamplingDefaults(temperature=0.0)).settings
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 5, 1.0)


def test_word_lists_round_trip() -> None:
    from qvl_trt.triton.contract import stop_words_list, word_list_sequences

    assert stop_words_list([]).tolist() == [[0], [-1]]
    words = [[5, 6], [7], [8, 9, 10]]
    table = stop_words_list(words)
    assert table.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]]
    assert word_list_sequences(table) == words
    assert word_list_sequences(stop_words_list([])) == []


# ---- vision cache ---------------------------------------------------------------------------

def test_row_cache_is_bounded_in_bytes_and_least_recently_used_goes_first() -> None:
    rows = np.zeros((4, 8), np.float16)  # 64 bytes
    cache = RowCache(capacity_bytes=150)
    cache.put(("a",), rows)
    cache.put(("b",), rows)
    assert cache.get(("a",)) is not None  # a is now the most recent
    cache.put(("c",), rows)  # 192 bytes > 150: b goes
    assert cache.get(("b",)) is None and cache.get(("c",)) is not None
    cache.put(("huge",), np.zeros((100, 8), np.float16))  # larger than the cache: not kept
    assert cache.get(("huge",)) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (2, 2, 2, 128)
    with pytest.raises(ValueError):
        cache.get(("a",))[0, 0] = 1  # cached rows are shared read-only


# ---- configs --------------------------------------------------------------------------------

def test_config_protobufs_parse_back_with_bool_parameters_and_scalar_reshapes() -> None:
    from qvl_trt.triton.model_configs import Flavor, StepSettings, step_configs
    from qvl_trt.triton.pbconfig import parameters, parse_config, to_text

    settings = StepSettings(c.ModelNames.for_build("b4"), Flavor.TRT, max_batch_size=4,
                            hidden_size=64, patch_dim=1536, table_dtype="FP16",
                            engine_dir="/models/b4_tensorrt_llm/1/engine")
    configs = step_configs(settings)
    assert set(configs) == set(c.ModelNames.for_build("b4").all()) == {
        "b4", "b4_preprocessing", "b4_vision_encoder", "b4_tensorrt_llm", "b4_postprocessing",
        "b4_tensorrt_llm_bls"}
    for name, config in configs.items():
        text = to_text(config)
        assert "${" not in text
        back = parse_config(text, name)
        assert back == config and back.max_batch_size == 4
    llm = configs["b4_tensorrt_llm"]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["enable_kv_cache_reuse"] == "true" and params["max_beam_width"] == "1"
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert llm.model_transaction_policy.decoupled
    lengths = next(i for i in llm.input if i.name == c.INPUT_LENGTHS)
    assert lengths.HasField("reshape") and list(lengths.reshape.shape) == []
    table = next(i for i in llm.input if i.name == c.PROMPT_EMBEDDING_TABLE)
    assert list(table.dims) == [-1, 64]
    post = configs["b4_postprocessing"]
    assert post.parameters["tensorrt_llm_model"].string_value == "b4_tensorrt_llm"
    steps = [s.model_name for s in configs["b4"].ensemble_scheduling.step]
    assert steps == ["b4_preprocessing", "b4_vision_encoder", "b4_postprocessing"]
    bls = configs["b4_tensorrt_llm_bls"]
    assert bls.model_transaction_policy.decoupled
    assert {k: v.string_value for k, v in bls.parameters.items()} == {
        "preprocessing_model": "b4_preprocessing", "vision_encoder_model": "b4_vision_encoder",
        "tensorrt_llm_model": "b4_tensorrt_llm", "workers": "8"}
    assert c.TensorrtLlmBlsParameters.from_parameters(parameters(bls)).workers == 8
    assert [i.name for i in bls.input] == [s.name for s in c.ENSEMBLE_INPUTS]
    assert [o.name for o in bls.output] == [s.name for s in c.ENSEMBLE_OUTPUTS]


def test_python_model_parameters_round_trip_and_name_a_bad_key() -> None:
    from qvl_trt.triton.pbconfig import new_config, parameters, set_parameters

    written = c.PreprocessingParameters(
        max_images=2, max_input_len=512, max_seq_len=640, min_pixels=4096, max_pixels=65536,
        max_visual_tokens=128, default_max_tokens=64, image_url_allow_list="a.com,b.org")
    config = new_config("pre", backend="python", max_batch_size=1)
    set_parameters(config, written.to_parameters())
    params = parameters(config)
    assert params["max_seq_len"] == "640"  # one name from the writer to the reader
    assert c.PreprocessingParameters.from_parameters(params) == written
    vision = c.VisionEncoderParameters(c.Flavor.REFERENCE, "auto", "float32", 2**20)
    assert vision.to_parameters()["flavor"] == "reference"
    assert c.VisionEncoderParameters.from_parameters(
        {k: str(v) for k, v in vision.to_parameters().items()}) == vision
    with pytest.raises(ConfigError, match=r"pre: missing key 'max_visual_tokens'"):
        c.PreprocessingParameters.from_parameters(
            {k: v for k, v in params.items() if k != "max_visual_tokens"}, "pre")
    with pytest.raises(ConfigError, match=r"post\.workers: expected an integer, got 'many'"):
        c.PostprocessingParameters.from_parameters(
            {"tensorrt_llm_model": "tensorrt_llm", "workers": "many"}, "post")
    with pytest.raises(ConfigError, match=r"unknown key 'max_positions'"):
        c.PreprocessingParameters.from_parameters({**params, "max_positions": "640"})
    with pytest.raises(ConfigError, match=r"'gpu' is not one of 'trt', 'reference'"):
        c.VisionEncoderParameters.from_parameters(
            {"flavor": "gpu", "device": "auto", "dtype": "float32", "cache_bytes": "1"})


def test_string_parameters_read_bools_as_set_parameters_writes_them() -> None:
    from dataclasses import dataclass

    from qvl_trt.triton.pbconfig import new_config, parameters, set_parameters
    from qvl_trt.typed_config import load_parameters, to_parameters

    @dataclass(frozen=True)
    class Flags:
        on: bool
        ratio: float

    config = new_config("m", backend="python", max_batch_size=1)
    set_parameters(config, to_parameters(Flags(True, 0.5)))
    assert parameters(config) == {"on": "true", "ratio": "0.5"}
    assert load_parameters(Flags, parameters(config), "m") == Flags(True, 0.5)
    with pytest.raises(ConfigError, match=r"m\.on: expected true or false, got 'yes'"):
        load_parameters(Flags, {"on": "yes", "ratio": "1"}, "m")
    with pytest.raises(ConfigError, match=r"m\.ratio: expected a number, got 'half'"):
        load_parameters(Flags, {"on": "true", "ratio": "half"}, "m")


# ---- the python models' error policy -------------------------------------------------------

def test_a_user_error_reaches_the_client_and_a_bug_only_by_its_type(caplog) -> None:
    from qvl_trt.triton.runtime.backend import guarded

    def refuse(text):
        raise InputError(f"{text} is too long; shorten it")

    def crash(text):
        return {}[text]

    sent: list[str] = []
    guarded("b4_preprocessing", sent.append, refuse, "prompt")
    assert sent == ["prompt is too long; shorten it"] and not caplog.records
    guarded("b4_preprocessing", sent.append, crash, "secret")
    assert sent[1] == "internal error in b4_preprocessing: KeyError"
    assert "secret" not in sent[1]
    (record,) = caplog.records
    assert record.exc_info[0] is KeyError and "b4_preprocessing" in record.getMessage()
    assert guarded("b4_preprocessing", sent.append, str.upper, "fine") == "FINE"
    assert len(sent) == 2


# ---- server command lines -------------------------------------------------------------------

INSTALL = TritonInstall(Path("/opt/tritonserver/bin/tritonserver"),
                        Path("/opt/tritonserver/backends"), "ngc", "2.71.0")


def test_tensor_parallel_launch_is_one_rank_per_gpu_through_mpirun() -> None:
    opts = ServerOptions(Path("/models"), Ports(9000, 9001, 9002), world_size=2,
                         llm_models=("a_tensorrt_llm", "b_tensorrt_llm"), shm_prefix="run7_")
    cmd = server_command(INSTALL, opts)
    assert cmd[0] == "mpirun" and cmd.count(":") == 1
    rank0, rank1 = " ".join(cmd).split(" : ")
    assert rank0.count("-n 1") == 1 and rank1.startswith("-n 1 /opt/tritonserver/bin/tritonserver")
    for rank, line in enumerate((rank0, rank1)):
        assert f"shm-region-prefix-name=run7_r{rank}_" in line
        assert "--model-repository=/models" in line and "--http-port=9000" in line
    assert "--model-control-mode=explicit" not in rank0
    assert ("--model-control-mode=explicit --load-model=a_tensorrt_llm "
            "--load-model=b_tensorrt_llm") in rank1
    assert format_command(cmd, INSTALL).startswith("mpirun ")


def test_single_rank_and_bad_world_sizes() -> None:
    opts = ServerOptions(Path("/models"), shm_prefix="p_")
    assert server_command(INSTALL, opts)[0] == "/opt/tritonserver/bin/tritonserver"
    with pytest.raises(ConfigError, match="world-size must be >= 1"):
        server_command(INSTALL, ServerOptions(Path("/m"), world_size=0))
    with pytest.raises(ConfigError, match="reference flavor"):
        server_command(INSTALL, ServerOptions(Path("/m"), world_size=2))


# ---- what the served code imports ------------------------------------------------------------

def _qvl_imports(path: Path, root: Path) -> set[str]:
    """qvl_trt modules a file imports, at any depth of it (imports inside functions too)."""
    import ast

    package = ".".join(path.relative_to(root).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: -node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "qvl_trt"}


def test_the_served_code_imports_neither_the_config_writer_nor_the_fixtures() -> None:
    root = Path(__file__).resolve().parents[1]
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (root / "qvl_trt").rglob("*.py")}
    todo = [p for p in (root / "triton_repo").glob("*/1/model.py")]
    assert len(todo) == 5
    reached: set[str] = set()
    while todo:
        for name in _qvl_imports(todo.pop(), root) - reached:
            if name in modules:
                reached.add(name)
                todo.append(modules[name])
    assert "qvl_trt.triton.runtime.backend" in reached
    forbidden = {"qvl_trt.triton.model_configs", "qvl_trt.triton.repository", "qvl_trt.testing"}
    assert not {m for m in reached if m in forbidden or m.startswith("qvl_trt.testing.")}
