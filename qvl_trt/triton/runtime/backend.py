"""Glue between Triton's python backend and the steps' plain functions: request tensors in,
response tensors out, errors as error responses (one policy for every python model:
`error_message`). Imported by the generated model.py files inside the python backend stub,
where `triton_python_backend_utils` exists."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from ...child import die_with_parent
from ...errors import InputError, StepError
from ..contract import ErrorKind, TensorSpec, config_parameters

log = logging.getLogger(__name__)
R = TypeVar("R")


def pb():
    import triton_python_backend_utils as pb_utils

    return pb_utils


# How often a python model's stub's watcher looks whether its tritonserver is still there.
SERVER_WATCH_S = 1


def exit_with_server() -> None:
    """Have this stub killed once tritonserver, its parent, is gone: a `sh` loop beside it
    (it dies with the stub: child.die_with_parent). The python backend's stub leaves by
    itself when its server dies only while no thread of it waits for the server: a thread
    in a metric update, a response or a BLS call blocks forever holding the GIL
    (python_backend Stub::SendMessage waits for the parent's answer), and the stub's own
    exit then waits for that thread's lock. So a tensorrt_llm or tensorrt_llm_bls stub with
    requests in flight ran on orphaned after a kill -9 of the server, holding its memory,
    its device and the build's admission places; a thread of its own could not help, it
    would wait for the GIL. Called first in every model's initialize()."""
    server, stub = os.getppid(), os.getpid()
    watch = (f"while kill -0 {server} 2>/dev/null; do sleep {SERVER_WATCH_S}; done; "
             f"kill -9 {stub}")
    subprocess.Popen(["/bin/sh", "-c", watch], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     preexec_fn=partial(die_with_parent, stub))


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """The model config's parameters (all string values), from initialize()'s args."""
    return config_parameters(json.loads(args["model_config"]))


def error_message(exc: Exception, model: str) -> str:
    """What a python model tells the client about `exc`, marked with its kind (ErrorKind): a
    QvlError is the client's to fix (or to send again later), its one-line message; anything
    else is a bug, logged with its traceback, and the client learns only its type (not
    internals)."""
    if isinstance(exc, StepError):
        return str(exc)  # marked where it was relayed
    kind = ErrorKind.of_error(exc)
    if kind is not ErrorKind.INTERNAL:
        return kind.mark(str(exc))
    log.error("internal error in %s", model, exc_info=exc)
    return kind.mark(f"{model}: {type(exc).__name__}")


def guarded(model: str, fail: Callable[[str], R], handle: Callable[..., R], *args: Any) -> R:
    """`handle(*args)`; if it raises, `fail(error_message(...))` instead."""
    try:
        return handle(*args)
    except Exception as exc:
        return fail(error_message(exc, model))


def run_requests(requests: Sequence[Any], handle: Callable[[Any], Mapping[str, Any]],
                 model: str) -> list[Any]:
    """execute() of a model that is not decoupled: per request, a response holding the
    outputs `handle(request)` returns, or an error response."""

    def answer(request: Any) -> Any:
        return response(handle(request))

    return [guarded(model, error_response, answer, request) for request in requests]


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


def send_error(sender: Any, message: str) -> None:
    """A decoupled request's final response: an error saying `message`."""
    sender.send(error_response(message), flags=pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)

