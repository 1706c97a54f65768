"""Glue between Triton's python backend and the steps' plain functions: request tensors in,
response tensors out, errors as error responses. Imported by the generated model.py files
inside the python backend stub, where `triton_python_backend_utils` exists."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ...errors import InputError
from ..contract import TensorSpec


def pb():
    import triton_python_backend_utils as pb_utils

    return pb_utils


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """The model config's parameters (all string values), from initialize()'s args."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def read_row(request: Any, specs: Iterable[TensorSpec]) -> dict[str, Any]:
    """The request's inputs as one batch row: name -> array without the batch dim, or the
    value itself for [1]-shaped inputs (bytes / numpy scalar). Absent optional inputs are
    left out. Batch rows beyond one are refused: each request is one conversation."""
    specs = tuple(specs)
    return row_of({s.name: pb().get_input_tensor_by_name(request, s.name) for s in specs},
                  specs)


def row_of(tensors: Mapping[str, Any], specs: Iterable[TensorSpec]) -> dict[str, Any]:
    """`read_row` over named tensors (a request's inputs, or a BLS response's outputs)."""
    row = {}
    for spec in specs:
        tensor = tensors.get(spec.name)
        if tensor is None:
            continue
        array = tensor.as_numpy()
        if array.shape[0] != 1:
            raise InputError(f"{spec.name} has a batch of {array.shape[0]} rows; send one "
                             "request per conversation (batch size 1)")
        value = array[0]
        row[spec.name] = value.reshape(-1)[0] if spec.dims == (1,) else value
    return row


def response(outputs: Mapping[str, Any]) -> Any:
    """A response whose tensors get the batch dim of one row."""
    tensors = []
    for name, value in outputs.items():
        if isinstance(value, str):
            value = np.array([value.encode("utf-8")], dtype=object)
        tensors.append(pb().Tensor(name, np.asarray(value)[None]))
    return pb().InferenceResponse(output_tensors=tensors)


def error_response(message: str) -> Any:
    return pb().InferenceResponse(error=pb().TritonError(message))


def pick_device(device: str) -> str:
    """"auto": the first CUDA device when torch sees one, else the CPU."""
    if device != "auto":
        return device
    from ...deps import require

    torch = require("torch", extra="export", why="run the vision tower")
    return "cuda" if torch.cuda.is_available() else "cpu"
