"""The hop benchmark's fixture that logs every execute() of a python model (bytes of its
tensors, entry and return times). scripts/bench_hops.py runs it inside a real tritonserver;
here the python backend's request and response objects are stood in for by plain ones with
the methods the wrapper calls (name, as_numpy, inputs, output_tensors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qvl_trt.testing.hop_timer import INNER, install_hop_timer, read_calls
from qvl_trt.triton.layout import MODEL_PY

MODEL = '''
class TritonPythonModel:
    def execute(self, requests):
        return [self.answer(r) for r in requests]
'''


def tensor(name: str, value: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(name=lambda: name, as_numpy=lambda: value)


def load(folder: Path):
    spec = importlib.util.spec_from_file_location("wrapped_model", folder / MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop("qvl_timed_model", None)
    return module.TritonPythonModel()


def test_each_execute_is_logged_with_its_tensor_bytes(tmp_path) -> None:
    (tmp_path / MODEL_PY).write_text(MODEL)
    install_hop_timer(tmp_path)
    assert (tmp_path / INNER).read_text() == MODEL
    model = load(tmp_path)
    model.answer = lambda r: SimpleNamespace(output_tensors=lambda: [
        tensor("table", np.zeros((3, 4), np.float16))])
    text = np.array([b"hello", b"image bytes"], dtype=object)  # BYTES: payload counted
    request = SimpleNamespace(inputs=lambda: [tensor("ids", np.zeros(5, np.int32)),
                                              tensor("text", text)])
    assert len(model.execute([request])) == 1
    model.execute([request, request])
    first, second = read_calls(tmp_path)
    assert first.entered_ns <= first.returned_ns <= second.entered_ns
    assert first.inputs == ({"ids": 20, "text": 16},)
    assert first.outputs == ({"table": 24},)
    assert len(second.inputs) == 2
    assert read_calls(tmp_path, skip=1) == [second]


def test_a_decoupled_model_logs_no_outputs_and_is_wrapped_once(tmp_path) -> None:
    (tmp_path / MODEL_PY).write_text(MODEL.replace("return [self.answer(r) for r in requests]",
                                                   "return None"))
    install_hop_timer(tmp_path)
    load(tmp_path).execute([SimpleNamespace(inputs=lambda: [])])
    assert read_calls(tmp_path)[0].outputs == ()
    with pytest.raises(FileExistsError):
        install_hop_timer(tmp_path)
