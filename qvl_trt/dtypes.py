"""The floating-point precisions qvl-trt moves weights and activations in, by their on-disk
name (torch's dtype name, as config.json, manifest.json and build_config.json hold it), with
the name of each in the other vocabularies it meets: Triton, safetensors, ONNX, torch.

Which precisions a step accepts is defined beside the step (vision/spec.py, llm/layout.py);
`pick` checks a value against such a set. The engines' precisions are here, because the build
options (manifest.py) stand on them below the steps.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .deps import require
from .errors import ConfigError
from .typed_config import OptionChoice


class Dtype(str, enum.Enum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"

    def __str__(self) -> str:  # f-strings and messages show the on-disk name
        return self.value

    @property
    def triton(self) -> str:
        """Triton's data type without the TYPE_ prefix (config.pbtxt, contract.TensorSpec)."""
        return _VIEWS[self].triton

    @property
    def safetensors(self) -> str:
        """The dtype tag of a safetensors header."""
        return _VIEWS[self].safetensors

    @property
    def onnx(self) -> int:
        """The onnx.TensorProto.DataType value (elem_type of a graph's value_info)."""
        return _VIEWS[self].onnx

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _VIEWS[self].itemsize

    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        return getattr(require("torch", extra="export", why=f"compute in {self.value}"),
                       self.value)


@dataclass(frozen=True)
class _Views:
    triton: str
    safetensors: str
    onnx: int
    itemsize: int


# ONNX values: TensorProto.DataType in onnx/onnx.proto (FLOAT = 1, FLOAT16 = 10,
# BFLOAT16 = 16), written here so reading them needs no onnx import.
_VIEWS = {
    Dtype.FLOAT16: _Views(triton="FP16", safetensors="F16", onnx=10, itemsize=2),
    Dtype.BFLOAT16: _Views(triton="BF16", safetensors="BF16", onnx=16, itemsize=2),
    Dtype.FLOAT32: _Views(triton="FP32", safetensors="F32", onnx=1, itemsize=4),
}

# What the repository's python models can take and give as numpy: the python backend maps no
# TYPE_BF16 to a numpy type (TRITON_STRING_TO_NUMPY, triton_to_numpy_type in python_backend
# src/resources/triton_python_backend_utils.py); numpy itself has no bfloat16.
NUMPY_DTYPES = (Dtype.FLOAT16, Dtype.FLOAT32)

# What `qvl-trt build` converts and builds the language model in. The trt flavor's python
# models hold the prompt table in the engine dtype as numpy, which has no bfloat16.
LLM_ENGINE_DTYPE = Dtype.FLOAT16
# What the vision engine takes (`--vision-dtype`); float32 is only the reference graph the
# export is validated with (vision/spec.py VISION_DTYPES).
VISION_ENGINE_DTYPES = (Dtype.FLOAT16, Dtype.BFLOAT16)


def pick(value: Any, allowed: Sequence[Dtype], what: str) -> Dtype:
    """`value` (a name or a Dtype) as a member of `allowed`; otherwise ConfigError
    "{what} 'value' is not one of a, b"."""
    if value not in allowed:
        raise ConfigError(f"{what} {str(value)!r} is not one of {', '.join(allowed)}")
    return Dtype(value)


class WeightOnly(OptionChoice):
    """How the language model's linear-layer weights are stored: in the model dtype, or
    quantized weight-only (TensorRT-LLM's QuantAlgo W8A16 / W4A16: integer weights with one
    scale per output channel in the model dtype, activations and everything else in the
    model dtype; no calibration data)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def option(cls) -> str:
        return "--weights"

    @property
    def quant_algo(self) -> str | None:
        """The checkpoint config's `quantization.quant_algo` (TensorRT-LLM QuantAlgo name)."""
        return {WeightOnly.INT8: "W8A16", WeightOnly.INT4: "W4A16"}.get(self)

    @property
    def bits(self) -> int | None:
        """Bits per stored weight value; None in the model dtype."""
        return {WeightOnly.INT8: 8, WeightOnly.INT4: 4}.get(self)

    def linear_bytes(self, in_features: int, out_features: int, dtype: Dtype) -> int:
        """Bytes of one linear layer's weight as the engine holds it: in the model dtype, or
        packed integers plus one `dtype` scale per output channel."""
        if self.bits is None:
            return in_features * out_features * dtype.itemsize
        return in_features * out_features * self.bits // 8 + out_features * dtype.itemsize
