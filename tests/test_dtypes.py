"""qvl_trt.dtypes: each precision's names in the vocabularies it meets, and `pick`."""

from __future__ import annotations

import json

import pytest

from qvl_trt.dtypes import NUMPY_DTYPES, Dtype, pick
from qvl_trt.errors import ConfigError

# Written out by hand from each format's documentation, not derived from the module.
VIEWS = {
    # value: (Triton, safetensors, itemsize)
    "float16": ("FP16", "F16", 2),
    "bfloat16": ("BF16", "BF16", 2),
    "float32": ("FP32", "F32", 4),
}


def test_members_are_the_on_disk_names():
    assert [d.value for d in Dtype] == ["float16", "bfloat16", "float32"]
    assert Dtype("bfloat16") is Dtype.BFLOAT16
    # What manifests, config.json and messages show: the plain name.
    assert json.dumps({"dtype": Dtype.BFLOAT16}) == '{"dtype": "bfloat16"}'
    assert f"{Dtype.FLOAT16}" == str(Dtype.FLOAT16) == "float16"
    assert Dtype.FLOAT32 == "float32"


@pytest.mark.parametrize("name", list(VIEWS))
def test_views(name):
    dtype = Dtype(name)
    assert (dtype.triton, dtype.safetensors, dtype.itemsize) == VIEWS[name]


def test_onnx_values_are_onnx_tensorproto():
    onnx = pytest.importorskip("onnx")
    assert Dtype.FLOAT16.onnx == onnx.TensorProto.FLOAT16 == 10
    assert Dtype.BFLOAT16.onnx == onnx.TensorProto.BFLOAT16 == 16
    assert Dtype.FLOAT32.onnx == onnx.TensorProto.FLOAT == 1


def test_triton_names_are_triton_data_types():
    pb2 = pytest.importorskip("qvl_trt.triton.pbconfig").pb2()
    for dtype in Dtype:
        assert pb2.DataType.Value(f"TYPE_{dtype.triton}") > 0


def test_torch_view():
    torch = pytest.importorskip("torch")
    assert Dtype.BFLOAT16.torch() is torch.bfloat16
    assert Dtype.FLOAT16.torch() is torch.float16
    assert Dtype.FLOAT32.torch() is torch.float32
    for dtype in Dtype:
        assert torch.empty(0, dtype=dtype.torch()).element_size() == dtype.itemsize


def test_numpy_dtypes():
    np = pytest.importorskip("numpy")
    # The python backend's TRITON_STRING_TO_NUMPY has TYPE_FP16 and TYPE_FP32, no TYPE_BF16.
    assert NUMPY_DTYPES == (Dtype.FLOAT16, Dtype.FLOAT32)
    for dtype in NUMPY_DTYPES:
        assert np.dtype(dtype.value).itemsize == dtype.itemsize


def test_pick():
    allowed = (Dtype.FLOAT16, Dtype.BFLOAT16)
    assert pick("bfloat16", allowed, "engine dtype") is Dtype.BFLOAT16
    assert pick(Dtype.FLOAT16, allowed, "engine dtype") is Dtype.FLOAT16
    with pytest.raises(ConfigError, match="^engine dtype 'float32' is not one of float16, "
                                          "bfloat16$"):
        pick(Dtype.FLOAT32, allowed, "engine dtype")
    with pytest.raises(ConfigError, match="^engine dtype 'int8' is not one of"):
        pick("int8", allowed, "engine dtype")
