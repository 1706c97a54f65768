"""Vision engines running on a GPU, against the fp32 PyTorch tower (itself checked against
Hugging Face in test_vision_export.py): the full-TensorRT engine (NGC TensorRT-LLM container,
any data-center GPU) and the TensorRT-RTX engine (RTX-class GPU: compute capability 8.0, 8.6,
8.9 or 12.x; TensorRT-RTX refuses 9.0). Run: scripts/verify_gpu.sh."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.deps import available
from qvl_trt.errors import BuildError, InputError
from qvl_trt.mm.vision_index import vision_index_tensors
from qvl_trt.profiles import TrtEdition
from qvl_trt.vision.engine import EngineBuildConfig, build_vision_engine, trt_module
from qvl_trt.vision.spec import PatchRange, vision_graph_spec

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; run scripts/verify_gpu.sh on one"),
]

GRIDS = [(1, 16, 16), (1, 8, 12), (1, 30, 4), (1, 36, 36)]
PATCHES = PatchRange(min=8, opt=256, max=2048)
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


def _cc() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def _build(tmp_path, tiny_ckpt, tiny_vision_onnx, edition: TrtEdition, dtype: str):
    ckpt = open_checkpoint(tiny_ckpt)
    folder = tmp_path / "vision"
    shutil.copytree(tiny_vision_onnx(dtype, edition).path.parent, folder / "onnx")
    spec = vision_graph_spec(ckpt.vision, dtype)
    build_vision_engine(folder, EngineBuildConfig(
        edition=edition, dtype=dtype, onnx="onnx/model.onnx", compute_capabilities=(_cc(),),
        patches=PATCHES, builder_optimization_level=3, workspace_gib=2.0, inputs=spec.inputs,
        outputs=spec.outputs, sources={}))
    return ckpt, folder


def _check_against_pytorch(ckpt, folder, dtype: str) -> None:
    from qvl_trt.vision.runner import VisionEngine
    from qvl_trt.vision.tower import example_inputs, load_vision_tower

    engine = VisionEngine(folder)
    reference = load_vision_tower(ckpt)
    for grid in GRIDS:
        inputs = example_inputs(ckpt, grid, seed=sum(grid))
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*inputs)]
        index = vision_index_tensors(grid, ckpt.vision)
        got = engine(inputs[0].cuda(), index)
        assert list(got) == [t["name"] for t in engine.config["outputs"]]
        for (name, out), ref in zip(got.items(), expected, strict=True):
            assert out.is_cuda and out.dtype == getattr(torch, dtype)
            ratio = float(np.abs(out.float().cpu().numpy() - ref).max() / np.abs(ref).max())
            print(f"{name} grid {grid}: max|diff|/max|ref| {ratio:.2e}")
            assert ratio <= TOLERANCE[dtype], (name, grid, ratio)
    # Inputs written on the caller's (non-default) stream are waited for: same outputs.
    grid = GRIDS[0]
    pixels, index = example_inputs(ckpt, grid, seed=sum(grid))[0], vision_index_tensors(
        grid, ckpt.vision)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = engine(pixels.cuda() * 1, index)
    for name, out in engine(pixels.cuda(), index).items():
        assert torch.equal(on_side[name], out), name
    big = (1, 64, 64)
    too_many = torch.zeros(64 * 64, ckpt.vision.patch_dim, dtype=torch.uint8).cuda()
    with pytest.raises(InputError, match="outside the engine's range"):
        engine(too_many, vision_index_tensors(big, ckpt.vision))
    # Past our own patch-count check, TensorRT's set_input_shape refuses it (returns False).
    engine.patches = {"min": 1, "max": 10**6}
    with pytest.raises(InputError, match=r"^vision engine input \w+ of shape \[\d+.*\] is "
                       r"outside the engine's range \[.*\]\.\.\[.*\]; resize"):
        engine(too_many, vision_index_tensors(big, ckpt.vision))


@pytest.mark.trt
@pytest.mark.skipif(not available("tensorrt"),
                    reason="needs full TensorRT (NGC TensorRT-LLM container); run "
                    "scripts/verify_gpu.sh there")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensorrt_engine_matches_pytorch(tmp_path, tiny_ckpt, tiny_vision_onnx, dtype) -> None:
    ckpt, folder = _build(tmp_path, tiny_ckpt, tiny_vision_onnx, TrtEdition.TENSORRT, dtype)
    _check_against_pytorch(ckpt, folder, dtype)


@pytest.mark.skipif(not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
                    reason="needs TensorRT-RTX: pip install 'qvl-trt[rtx]'")
def test_rtx_engine_matches_pytorch(tmp_path, tiny_ckpt, tiny_vision_onnx) -> None:
    trt = trt_module(TrtEdition.TENSORRT_RTX)
    sm = "SM" + _cc().replace(".", "")
    if not hasattr(trt.ComputeCapability, sm):
        pytest.skip(f"TensorRT-RTX does not run on compute capability {_cc()} "
                    f"({torch.cuda.get_device_name()}); needs an RTX-class GPU")
    ckpt, folder = _build(tmp_path, tiny_ckpt, tiny_vision_onnx, TrtEdition.TENSORRT_RTX,
                          "float16")
    _check_against_pytorch(ckpt, folder, "float16")


@pytest.mark.skipif(not (available("tensorrt_rtx") or available("tensorrt_rtx_bindings")),
                    reason="needs TensorRT-RTX: pip install 'qvl-trt[rtx]'")
def test_engine_for_another_gpu_is_refused(tmp_path, tiny_ckpt, tiny_vision_onnx) -> None:
    """An engine built for another compute capability is refused on load, before
    TensorRT is asked to deserialize it."""
    import json

    from qvl_trt.vision.runner import VisionEngine

    ckpt = open_checkpoint(tiny_ckpt)
    folder = tmp_path / "vision"
    shutil.copytree(tiny_vision_onnx("float16").path.parent, folder / "onnx")
    spec = vision_graph_spec(ckpt.vision, "float16")
    other = "8.6" if _cc() != "8.6" else "8.9"
    build_vision_engine(folder, EngineBuildConfig(
        edition=TrtEdition.TENSORRT_RTX, dtype="float16", onnx="onnx/model.onnx",
        compute_capabilities=(other,), patches=PATCHES, builder_optimization_level=3,
        workspace_gib=2.0, inputs=spec.inputs, outputs=spec.outputs, sources={}))
    assert json.loads((folder / "config.json").read_text())["compute_capabilities"] == [other]
    with pytest.raises(BuildError, match=f"built for compute capability {other}"):
        VisionEngine(folder)
