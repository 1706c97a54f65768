"""The export-friendly vision tower and its ONNX graphs vs the Hugging Face vision tower
(transformers' `Qwen3VLForConditionalGeneration.from_pretrained(tiny).model.visual`), run with
onnxruntime on six image sizes, only one of them the traced size. Graphs for TensorRT-RTX
(attention as the ONNX Attention op, opset 23) and for full TensorRT (opset 18)."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import BuildError, ConfigError
from qvl_trt.mm.pixels import PixelConfig
from qvl_trt.profiles import TrtEdition
from qvl_trt.vision.export import EXAMPLE_GRID, OPSETS, check_onnx_io, export_vision_onnx
from qvl_trt.vision.spec import GraphSpec, GraphTensor, vision_graph_spec
from qvl_trt.vision.validate import (
    DEFAULT_GRIDS,
    TOLERANCES,
    compare_with_hf,
    validate_vision_onnx,
)

RTX, TRT = TrtEdition.TENSORRT_RTX, TrtEdition.TENSORRT
torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def hf_visual(tiny_hf_model):
    """transformers' own tower: Qwen3VLForConditionalGeneration.from_pretrained(tiny)
    .model.visual."""
    return tiny_hf_model.model.visual


def _report(result) -> None:
    print(f"\n{result.graph} on {len(result.grids)} image sizes:")
    for line in result.lines():
        print("  " + line)


def test_grids_include_sizes_other_than_the_traced_one() -> None:
    assert len(DEFAULT_GRIDS) >= 5
    assert len({g for g in DEFAULT_GRIDS if g != EXAMPLE_GRID}) >= 4


def test_pytorch_tower_matches_hf(tiny_ckpt, hf_visual) -> None:
    from qvl_trt.vision.tower import load_vision_tower

    ckpt = open_checkpoint(tiny_ckpt)
    tower = load_vision_tower(ckpt)

    def run(inputs):
        with torch.no_grad():
            return [o.numpy() for o in tower(*inputs)]

    result = compare_with_hf(run, ckpt, dtype="float32", graph="VisionTower (PyTorch)",
                             grids=DEFAULT_GRIDS, reference=hf_visual)
    _report(result)
    assert result.passed


@pytest.mark.parametrize("dtype,edition", [("float32", RTX), ("float16", RTX),
                                           ("float16", TRT)])
def test_onnx_matches_hf(tiny_ckpt, tiny_vision_onnx, hf_visual, dtype, edition) -> None:
    exported = tiny_vision_onnx(dtype, edition)
    result = validate_vision_onnx(exported.path, open_checkpoint(tiny_ckpt), dtype=dtype,
                                  grids=DEFAULT_GRIDS, reference=hf_visual)
    _report(result)
    assert [c.name for c in result.checks] == ["image_embeds", "deepstack_0", "deepstack_1",
                                               "deepstack_2"]
    assert all(c.tolerance == TOLERANCES[dtype] for c in result.checks)
    assert result.passed, result.lines()


def test_a_wrong_graph_fails_validation(tiny_ckpt, tiny_vision_onnx, hf_visual) -> None:
    """The check can fail: the fp32 graph with two DeepStack outputs swapped, and the fp16
    graph held to the fp32 tolerance, are both refused."""
    ort = pytest.importorskip("onnxruntime")
    ckpt = open_checkpoint(tiny_ckpt)
    session = ort.InferenceSession(str(tiny_vision_onnx("float32").path))
    names = [i.name for i in session.get_inputs()]

    def swapped(inputs):
        outs = session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})
        return [outs[0], outs[2], outs[1], outs[3]]

    result = compare_with_hf(swapped, ckpt, dtype="float32", graph="swapped", grids=[(1, 8, 12)],
                             reference=hf_visual)
    _report(result)
    assert [c.passed for c in result.checks] == [True, False, False, True]
    assert "FAIL" in result.lines()[1]
    with pytest.raises(BuildError, match="deepstack_0, deepstack_1"):
        result.raise_if_failed()

    fp16 = validate_vision_onnx(tiny_vision_onnx("float16").path, ckpt, dtype="float16",
                                grids=[(1, 8, 12)], reference=hf_visual)
    strict = compare_with_hf(lambda inputs: _ort(tiny_vision_onnx("float16").path, inputs), ckpt,
                             dtype="float32", graph="fp16 held to 1e-5", grids=[(1, 8, 12)],
                             reference=hf_visual)
    assert fp16.passed and not strict.passed


def _ort(path, inputs):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})


def test_shape_mismatch_is_an_error(tiny_ckpt, hf_visual) -> None:
    ckpt = open_checkpoint(tiny_ckpt)

    def truncated(inputs):
        return [np.zeros((1, ckpt.vision.out_hidden_size), np.float32)] * 4

    with pytest.raises(BuildError, match="shape"):
        compare_with_hf(truncated, ckpt, dtype="float32", graph="truncated",
                        grids=[(1, 8, 12)], reference=hf_visual)


@pytest.mark.parametrize("dtype,edition", [("float32", RTX), ("float16", RTX),
                                           ("float16", TRT)])
def test_graph_structure(tiny_ckpt, tiny_vision_onnx, dtype, edition) -> None:
    exported = tiny_vision_onnx(dtype, edition)
    ckpt = open_checkpoint(tiny_ckpt)
    check_onnx_io(exported.path, vision_graph_spec(ckpt.vision, dtype))
    model = onnx.load(str(exported.path), load_external_data=False)
    opset = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    assert opset == [OPSETS[edition]] == [exported.opset]
    assert (exported.path.parent / "model.onnx.data").is_file()  # external weights
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert "Conv" not in ops  # the patch embedding is a MatMul
    # One attention per block, without a mask input.
    if edition is RTX:
        attention = [n for n in model.graph.node if n.op_type == "Attention"]
        assert len(attention) == ckpt.vision.depth and "Softmax" not in ops
        assert all(len(n.input) == 3 for n in attention)
    else:
        assert ops["Softmax"] == ckpt.vision.depth and "Attention" not in ops
    assert not any(n.op_type in ("Where", "NonZero", "Loop", "If") for n in model.graph.node)
    # Every LayerNorm runs in fp32, also in the fp16 graph (its scale is an fp32 weight).
    inits = {i.name: i.data_type for i in model.graph.initializer}
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == 2 * ckpt.vision.depth + 1 + ckpt.vision.deepstack_count
    assert {inits[n.input[1]] for n in norms} == {onnx.TensorProto.FLOAT}
    if dtype == "float16":
        half = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
        assert sum(int(np.prod(i.dims)) for i in half) > 0.9 * sum(
            int(np.prod(i.dims)) for i in model.graph.initializer)


@pytest.mark.parametrize("dtype,edition", [("float32", RTX), ("float16", TRT)])
def test_graph_normalises_pixels_as_the_processor_does(tiny_ckpt, tiny_vision_onnx, dtype,
                                                       edition) -> None:
    """What the patch embedding gets from the graph, run by onnxruntime on every uint8 value
    in every column, is the processor's float pixel to the last bit (cast to the graph's
    dtype)."""
    import onnxruntime as ort

    ckpt = open_checkpoint(tiny_ckpt)
    model = onnx.load(str(tiny_vision_onnx(dtype, edition).path))
    embed = next(n for n in model.graph.node if n.op_type in ("Gemm", "MatMul"))
    head = onnx.utils.Extractor(model).extract_model(["pixel_values"], [embed.input[0]])
    session = ort.InferenceSession(head.SerializeToString(), providers=["CPUExecutionProvider"])
    rows = np.arange(256)[:, None] + np.arange(ckpt.vision.patch_dim)[None, :]
    pixels = (rows % 256).astype(np.uint8)  # every column sees all 256 values
    (got,) = session.run(None, {"pixel_values": pixels})
    want = PixelConfig.of_checkpoint(ckpt).normalise(pixels).astype(got.dtype)
    assert got.dtype == np.dtype(dtype) and got.tobytes() == want.tobytes()


def _toy_graph(path, *nodes, initializers=()) -> None:
    """A graph from uint8 `pixels` [n, 4] to float32 `y` [n, 4] made of `nodes`."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        list(nodes), "toy", [helper.make_tensor_value_info("pixels", TensorProto.UINT8,
                                                           ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        initializer=list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def _cast(x: str, to: int, out: str):
    return onnx.helper.make_node("Cast", [x], [out], to=to)


_TOY_SPEC = GraphSpec((GraphTensor("pixels", "uint8", ("n", 4)),),
                      (GraphTensor("y", "float32", ("n", 4)),))


def test_uint8_input_may_feed_one_cast_to_float32(tmp_path) -> None:
    _toy_graph(tmp_path / "ok.onnx", _cast("pixels", onnx.TensorProto.FLOAT, "y"))
    check_onnx_io(tmp_path / "ok.onnx", _TOY_SPEC)


@pytest.mark.parametrize("uses,found", [
    ("int32", "Cast to int32"),  # TensorRT-RTX builds it; full TensorRT documents no such cast
    ("float16", "Cast to float16"),
    ("reshape", "Reshape"),  # no layer but a cast may take uint8 (NVIDIA/TensorRT#3985)
    ("two casts", "Cast to float32, Cast to float32"),
    ("in branches", "Cast to float32, Cast to float32"),  # each If branch casts it
])
def test_uint8_input_feeding_anything_else_is_refused(tmp_path, uses, found) -> None:
    from onnx import TensorProto, helper, numpy_helper

    branch = helper.make_graph([_cast("pixels", TensorProto.FLOAT, "t")], "branch", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["n", 4])])
    nodes = {
        "int32": [_cast("pixels", TensorProto.INT32, "i"), _cast("i", TensorProto.FLOAT, "y")],
        "float16": [_cast("pixels", TensorProto.FLOAT16, "h"),
                    _cast("h", TensorProto.FLOAT, "y")],
        "reshape": [onnx.helper.make_node("Reshape", ["pixels", "shape"], ["r"]),
                    _cast("r", TensorProto.FLOAT, "y")],
        "two casts": [_cast("pixels", TensorProto.FLOAT, "a"),
                      _cast("pixels", TensorProto.FLOAT, "b"),
                      onnx.helper.make_node("Add", ["a", "b"], ["y"])],
        "in branches": [onnx.helper.make_node("If", ["cond"], ["y"], then_branch=branch,
                                              else_branch=branch)],
    }[uses]
    constants = [numpy_helper.from_array(np.array([-1, 4], np.int64), "shape"),
                 numpy_helper.from_array(np.array(True), "cond")]
    _toy_graph(tmp_path / "bad.onnx", *nodes, initializers=constants)
    with pytest.raises(BuildError, match=f"^{re.escape(str(tmp_path / 'bad.onnx'))}: uint8 "
                                         f"input 'pixels' feeds {found}; full TensorRT takes a "
                                         "uint8 input only into one Cast to float32 .*re-export"):
        check_onnx_io(tmp_path / "bad.onnx", _TOY_SPEC)


def test_bfloat16_export(tiny_ckpt, tiny_vision_onnx) -> None:
    """onnxruntime has no CPU bf16 kernels: the graph's I/O is checked and the bf16 PyTorch
    module that was exported is compared with HF (within the bf16 tolerance)."""
    exported = tiny_vision_onnx("bfloat16")
    result = validate_vision_onnx(exported.path, open_checkpoint(tiny_ckpt), dtype="bfloat16",
                                  grids=[(1, 16, 16), (1, 8, 12)])
    _report(result)
    assert "PyTorch" in result.graph and result.passed
    model = onnx.load(str(exported.path), load_external_data=False)
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {
        onnx.TensorProto.BFLOAT16}


def test_export_refuses_a_non_empty_folder(tiny_ckpt, tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(BuildError, match="not an empty folder"):
        export_vision_onnx(open_checkpoint(tiny_ckpt), tmp_path, dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_export_refuses_a_dtype_it_has_no_graph_for(tiny_ckpt, tmp_path) -> None:
    with pytest.raises(ConfigError, match="^vision dtype 'int8' is not one of float16, "
                                          "bfloat16, float32$"):
        export_vision_onnx(open_checkpoint(tiny_ckpt), tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()
