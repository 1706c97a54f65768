"""Triton model configs as `inference.ModelConfig` protobufs: build, write, parse.

Configs are built as messages and written with `text_format`, so every file Triton reads went
through the schema. The generated module ships with tritonclient
(`tritonclient/grpc/model_config_pb2.py`); it is loaded by file path because importing the
`tritonclient.grpc` package would also import grpcio, which this does not need.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from ..atomic import staged_file
from ..deps import require
from ..errors import ConfigError, DependencyError
from .contract import TensorSpec

CONFIG_FILE = "config.pbtxt"


@functools.cache
def pb2() -> ModuleType:
    """The `model_config_pb2` module of the installed tritonclient."""
    tritonclient = require("tritonclient", extra="serve", why="write Triton model configs")
    path = Path(next(iter(tritonclient.__path__))) / "grpc" / "model_config_pb2.py"
    if not path.is_file():
        raise DependencyError(f"{path} is missing; reinstall with: pip install 'qvl-trt[serve]'")
    spec = importlib.util.spec_from_file_location("_qvl_trt_model_config_pb2", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # protobuf runtime older than the generated code, typically
        raise DependencyError(
            f"cannot load tritonclient's model_config_pb2 ({exc}); tritonclient 2.73 needs "
            "protobuf >= 6.33.5: pip install 'protobuf>=6.33.5'") from None
    return module


def new_config(name: str, **fields: Any) -> Any:
    """An empty ModelConfig called `name` with scalar `fields` set."""
    return pb2().ModelConfig(name=name, **fields)


def data_type(name: str) -> int:
    """Contract type name ("INT32", "BYTES", ...) -> the DataType enum value."""
    return pb2().DataType.Value("TYPE_STRING" if name == "BYTES" else f"TYPE_{name}")


def data_type_name(value: int) -> str:
    """DataType enum value -> contract type name (TYPE_STRING -> "BYTES")."""
    name = pb2().DataType.Name(value).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def add_inputs(config: Any, specs: Iterable[TensorSpec]) -> None:
    for s in specs:
        entry = config.input.add(name=s.name, data_type=data_type(s.data_type), dims=s.dims,
                                 optional=s.optional, allow_ragged_batch=s.ragged)
        if s.reshape is not None:
            # An empty reshape (a scalar per batch row) must still be present: SetInParent.
            entry.reshape.SetInParent()
            entry.reshape.shape.extend(s.reshape)


def add_outputs(config: Any, specs: Iterable[TensorSpec]) -> None:
    for s in specs:
        config.output.add(name=s.name, data_type=data_type(s.data_type), dims=s.dims)


def set_parameters(config: Any, params: Mapping[str, str | int | float | bool]) -> None:
    """Backend parameters: Triton stores them all as strings; bools become "true"/"false"."""
    for key, value in params.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        config.parameters[key].string_value = text


def get_parameter(config: Any, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def parameters(config: Any) -> dict[str, str]:
    """Every parameter of a config, key -> string_value."""
    return {key: value.string_value for key, value in config.parameters.items()}


def instance_count(config: Any) -> int:
    """The instances Triton runs of a model with KIND_CPU groups: a group's count below 1
    means Triton's default, 1 for the python backend (core model_config_utils.cc
    SetDefaultInstanceCount); no group at all, one instance."""
    return sum(max(1, group.count) for group in config.instance_group) or 1


def to_text(config: Any) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(config)


def write_config(config: Any, model_dir: Path) -> Path:
    """Write `model_dir/config.pbtxt` atomically and return its path."""
    path = Path(model_dir) / CONFIG_FILE
    text = to_text(config)
    parse_config(text, str(path))  # what we write must read back
    with staged_file(path, "w") as f:
        f.write(text)
    return path


def parse_config(text: str, where: str) -> Any:
    """Parse config.pbtxt text; a schema error names the file and the fix."""
    from google.protobuf import text_format

    try:
        return text_format.Parse(text, pb2().ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigError(f"{where} is not a valid Triton model config ({exc}); regenerate "
                          "it with `qvl-trt repo`") from None


def read_config(model_dir: Path) -> Any:
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing; regenerate the repository with `qvl-trt repo`")
    return parse_config(path.read_text(), str(path))
