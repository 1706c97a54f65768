"""Strict mapping -> frozen dataclass conversion, so configuration read from TOML or JSON is
validated at the edge and every error names the key and the value received."""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
C = TypeVar("C", bound="OptionChoice")


class OptionChoice(str, enum.Enum):
    """A choice a CLI option takes by value (`--weights int8`); a subclass names its option in
    `option()` for the errors."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def option(cls) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls: type[C], value: Any) -> C:
        """`value` (a name or a member) as a member; otherwise ConfigError naming the choices."""
        if value not in tuple(cls):
            raise ConfigError(f"{cls.option()} {value}: one of {', '.join(c.value for c in cls)}")
        return cls(value)

    @classmethod
    def parse_list(cls: type[C], text: str) -> tuple[C, ...]:
        """`none,int8` -> (NONE, INT8), each once, in the order given."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise ConfigError(f"{cls.option()} {text!r} names no choice; pass one or more of "
                              f"{', '.join(c.value for c in cls)}, comma-separated")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{cls.option()} {text}: {', '.join(twice)} given more than once; "
                              "name each once")
        return tuple(cls.parse(n) for n in names)


def load_dataclass(cls: type[T], data: Any, where: str) -> T:
    """Build `cls` from `data`, rejecting missing, unknown and wrongly typed keys.

    `where` prefixes every message (e.g. "profile my.toml [limits]"). Nested dataclass fields
    take nested tables.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is not dataclasses.MISSING:
                continue
            raise ConfigError(f"{where}: missing key {name!r}")
        values[name] = _coerce(hints[name], data[name], f"{where}.{name}")
    return cls(**values)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return load_dataclass(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{where}: {value!r} is not one of {allowed}") from None
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    # bool is an int subclass: `max_batch_size = true` must not pass as 1.
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def to_jsonable(obj: Any) -> Any:
    """A dataclass tree as plain JSON values (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def load_parameters(cls: type[T], params: Mapping[str, str], where: str) -> T:
    """`load_dataclass` over a Triton model's parameters, whose values are all strings: each
    is read as its field's type first (bools as "true"/"false", as `pbconfig.set_parameters`
    writes them)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, text in params.items():
        tp = hints.get(key)
        values[key] = text if tp is None else _from_text(tp, text, f"{where}.{key}")
    return load_dataclass(cls, values, where)


def _from_text(tp: Any, text: str, where: str) -> Any:
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        kind = "an integer" if tp is int else "a number"
        raise ConfigError(f"{where}: expected {kind}, got {text!r}") from None
    if tp is bool:
        if text not in ("true", "false"):
            raise ConfigError(f"{where}: expected true or false, got {text!r}")
        return text == "true"
    return text  # str, and enums (load_dataclass converts those)


def to_parameters(obj: Any) -> dict[str, str | int | float | bool]:
    """A flat dataclass as Triton model parameters (enums by value); the inverse of
    `load_parameters`."""
    return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
