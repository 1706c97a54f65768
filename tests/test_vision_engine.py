"""A real TensorRT-RTX engine built here, without a GPU, from the tiny checkpoint's FP16 ONNX;
the files beside it; the build's failure paths; the runner's refusals (which need no GPU).
Running engines on a GPU: tests/test_vision_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.child import REPRODUCE_NAME
from qvl_trt.deps import available
from qvl_trt.errors import BuildError, ConfigError, StageUnavailable
from qvl_trt.hashing import FileHasher
from qvl_trt.manifest import (
    BUILD_CONFIG_NAME,
    BUILD_LOG_NAME,
    CONFIG_NAME,
    TIMING_CACHE_NAME,
    VISION_ENGINE_NAME,
)
from qvl_trt.profiles import TrtEdition, load_profile
from qvl_trt.typed_config import load_dataclass
from qvl_trt.vision.engine import (
    EngineBuildConfig,
    build_vision_engine,
    check_edition_here,
    trt_module,
)
from qvl_trt.vision.runner import check_engine_gpu, check_engine_runtime, check_rtx_validity
from qvl_trt.vision.spec import patch_range, vision_graph_spec

needs_rtx = pytest.mark.skipif(
    not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
    reason="needs TensorRT-RTX: pip install 'qvl-trt[rtx]'")


def _config(ckpt, dtype: str = "float16", cc: str = "8.9") -> EngineBuildConfig:
    spec = vision_graph_spec(ckpt.vision, dtype)
    return EngineBuildConfig(
        edition=TrtEdition.TENSORRT_RTX, dtype=dtype, onnx="onnx/model.onnx",
        compute_capabilities=(cc,), patches=patch_range(ckpt.vision, load_profile("4090d").limits),
        builder_optimization_level=3, workspace_gib=4.0, inputs=spec.inputs,
        outputs=spec.outputs, sources={"weights": {"model.safetensors": "0" * 64}})


def _folder_with_onnx(tmp: Path, exported) -> Path:
    folder = tmp / "vision"
    shutil.copytree(exported.path.parent, folder / "onnx")
    return folder


@pytest.fixture(scope="module")
def rtx_engine(tmp_path_factory, tiny_ckpt, tiny_vision_onnx) -> Path:
    if not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")):
        pytest.skip("needs TensorRT-RTX: pip install 'qvl-trt[rtx]'")
    folder = _folder_with_onnx(tmp_path_factory.mktemp("rtx"), tiny_vision_onnx("float16"))
    build_vision_engine(folder, _config(open_checkpoint(tiny_ckpt)))
    return folder


@needs_rtx
def test_rtx_engine_and_its_config(rtx_engine: Path, tiny_ckpt) -> None:
    trt = trt_module(TrtEdition.TENSORRT_RTX)
    ckpt = open_checkpoint(tiny_ckpt)
    config = json.loads((rtx_engine / CONFIG_NAME).read_text())
    engine = rtx_engine / VISION_ENGINE_NAME
    assert engine.stat().st_size == config["engine_bytes"] > 100_000
    assert config["edition"] == "tensorrt_rtx" and config["trt_version"] == trt.__version__
    assert config["compute_capabilities"] == ["8.9"] and config["dtype"] == "float16"
    # 8 patches: two merge blocks, the least a video's pair of small frames can make.
    assert config["patches"] == {"min": 8, "opt": 8160, "max": 8192}
    assert config["shapes"]["pixel_values"] == [[8, 1536], [8160, 1536], [8192, 1536]]
    assert config["inputs"][0]["name"] == "pixel_values"
    assert config["inputs"][0]["dtype"] == "uint8"  # the 8-bit pixels, normalised in the graph
    assert config["shapes"]["rope_position_ids"] == [[8, 2], [8160, 2], [8192, 2]]
    assert [t["name"] for t in config["outputs"]] == ["image_embeds", "deepstack_0",
                                                      "deepstack_1", "deepstack_2"]
    assert {t["dtype"] for t in config["outputs"]} == {"float16"}
    assert config["outputs"][0]["shape"] == ["num_tokens", ckpt.vision.out_hidden_size]
    assert config["sources"]["onnx"] == FileHasher().hash(rtx_engine / "onnx" / "model.onnx")
    assert config["sources"]["weights"] == {"model.safetensors": "0" * 64}
    assert config["builder_optimization_level"] == 3 and config["workspace_gib"] == 4.0


@needs_rtx
def test_build_files_reproduce_the_engine(rtx_engine: Path, tiny_ckpt, tmp_path) -> None:
    build_config = json.loads((rtx_engine / BUILD_CONFIG_NAME).read_text())
    loaded = load_dataclass(EngineBuildConfig, build_config, BUILD_CONFIG_NAME)
    assert loaded == _config(open_checkpoint(tiny_ckpt))
    log = (rtx_engine / BUILD_LOG_NAME).read_text()
    assert "qvl_trt.vision.tensorrt" in log  # TensorRT's logger, through Python logging
    assert "Total Activation Memory" in log
    # reproduce.sh rebuilds the same engine config in a copy of the folder.
    copy = tmp_path / "copy"
    shutil.copytree(rtx_engine, copy)
    (copy / VISION_ENGINE_NAME).unlink()
    subprocess.run(["bash", str(copy / REPRODUCE_NAME)], check=True, capture_output=True,
                   env={**os.environ, "PYTHON": sys.executable})
    # config.json holds no times or paths: the same bytes (the engine's size included; its
    # bytes may differ, see qvl_trt.manifest). No timing cache: a no-op since TensorRT-RTX 1.2.
    assert (copy / CONFIG_NAME).read_bytes() == (rtx_engine / CONFIG_NAME).read_bytes()
    assert not (copy / TIMING_CACHE_NAME).exists()


@needs_rtx
def test_bfloat16_engine_builds(tmp_path, tiny_ckpt, tiny_vision_onnx) -> None:
    folder = _folder_with_onnx(tmp_path, tiny_vision_onnx("bfloat16"))
    config = build_vision_engine(folder, _config(open_checkpoint(tiny_ckpt), "bfloat16", "8.6"))
    assert config["dtype"] == "bfloat16" and config["compute_capabilities"] == ["8.6"]
    assert {t["dtype"] for t in config["outputs"]} == {"bfloat16"}


@needs_rtx
def test_unparsable_onnx_is_a_build_error(tmp_path, tiny_ckpt, tiny_vision_onnx) -> None:
    folder = _folder_with_onnx(tmp_path, tiny_vision_onnx("float16"))
    (folder / "onnx" / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(BuildError) as info:
        build_vision_engine(folder, _config(open_checkpoint(tiny_ckpt)))
    message = str(info.value)
    assert "cannot parse" in message and f"bash {folder / REPRODUCE_NAME}" in message
    assert not (folder / VISION_ENGINE_NAME).exists()
    assert "cannot parse" in (folder / BUILD_LOG_NAME).read_text()


@needs_rtx
def test_uint8_input_cast_to_int32_is_refused(tmp_path, tiny_ckpt, tiny_vision_onnx) -> None:
    """TensorRT-RTX builds a network whose uint8 input is cast to int32 (the vision graph was
    once made so); full TensorRT documents no such cast, so the build refuses it whichever
    edition builds."""
    onnx = pytest.importorskip("onnx")
    folder = _folder_with_onnx(tmp_path, tiny_vision_onnx("float16"))
    path = folder / "onnx" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    cast = next(n for n in model.graph.node if "pixel_values" in n.input)
    next(a for a in cast.attribute if a.name == "to").i = onnx.TensorProto.INT32
    onnx.save(model, str(path))
    with pytest.raises(BuildError, match="network of .*model.onnx: uint8 input 'pixel_values' "
                                         "feeds Cast to int32; full TensorRT takes"):
        build_vision_engine(folder, _config(open_checkpoint(tiny_ckpt)))
    assert not (folder / VISION_ENGINE_NAME).exists()


@needs_rtx
def test_edition_checks_before_export() -> None:
    with pytest.raises(ConfigError, match="compute capability 9.0.*--trt-edition tensorrt"):
        check_edition_here(TrtEdition.TENSORRT_RTX, ("9.0",), lambda: "resume here")
    check_edition_here(TrtEdition.TENSORRT_RTX, ("8.6", "8.9", "12.0"), lambda: "resume here")


@pytest.mark.skipif(available("tensorrt"), reason="full TensorRT is installed here")
def test_full_tensorrt_absent_stops_the_stage() -> None:
    with pytest.raises(StageUnavailable, match="needs full TensorRT.*resume here"):
        check_edition_here(TrtEdition.TENSORRT, ("9.0",), lambda: "resume here")


@needs_rtx
def test_runner_refuses_foreign_engines(rtx_engine: Path) -> None:
    trt = trt_module(TrtEdition.TENSORRT_RTX)
    config = json.loads((rtx_engine / CONFIG_NAME).read_text())
    check_engine_runtime(config, trt)
    check_engine_gpu(config, "8.9")
    with pytest.raises(BuildError, match="built with tensorrt, this runtime is tensorrt_rtx"):
        check_engine_runtime({**config, "edition": "tensorrt"}, trt)
    with pytest.raises(BuildError, match=r"built with tensorrt_rtx 1\.6\.0\.1, this runtime"):
        check_engine_runtime({**config, "trt_version": "1.6.0.1"}, trt)
    with pytest.raises(BuildError, match="built for compute capability 8.9, this GPU is 8.6"):
        check_engine_gpu(config, "8.6")


@needs_rtx
def test_rtx_validity_api_is_asked(rtx_engine: Path) -> None:
    """Runtime.get_engine_validity reads the header; it rejects a malformed engine, and
    here (no GPU) also the real one, with TensorRT-RTX's own reason."""
    trt = trt_module(TrtEdition.TENSORRT_RTX)
    with pytest.raises(BuildError, match="malformed engine.*qvl-trt build --only vision"):
        check_rtx_validity(trt, b"\0" * 256)
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        with pytest.raises(BuildError, match="invalid on this system"):
            check_rtx_validity(trt, (rtx_engine / VISION_ENGINE_NAME).read_bytes())


def test_build_config_round_trips(tiny_ckpt) -> None:
    from qvl_trt.typed_config import to_jsonable

    config = _config(open_checkpoint(tiny_ckpt))
    again = load_dataclass(EngineBuildConfig, json.loads(json.dumps(to_jsonable(config))), "x")
    assert again == config
    assert dataclasses.replace(again, dtype="bfloat16") != config
