"""Config dataclasses from TOML files and command-line flags, one-to-one with their fields.

Precedence: field defaults < the TOML file's table < flags given on the command line. A nested
dataclass field (``ServerConfig.train``) reads from its own sub-table (``[server.train]``) or
from flat keys in the parent table; on the command line its fields appear without a prefix.
Unknown keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _flat_fields(cls: type) -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    """(name, type, field) for every leaf field, nested dataclasses flattened."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out.extend(_flat_fields(t))
        else:
            out.append((f.name, t, f))
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str,
                  skip: tuple[str, ...] = ()) -> None:
    """One flag per leaf field of ``cls``; defaults stay None so given flags can be told apart."""
    group = parser.add_argument_group(title)
    taken = {a.dest for a in parser._actions}
    for name, t, f in _flat_fields(cls):
        if name in skip or name in taken:  # a shared name (e.g. seed) is one flag for both
            continue
        taken.add(name)
        default = f.default if f.default is not dataclasses.MISSING else None
        helptext = f"(default: {default!r})" if default not in (None, "") else None
        if f.metadata.get("help"):  # a field's own help text says what it is for
            helptext = f.metadata["help"]
        if t is bool:
            group.add_argument(_flag(name), dest=name, default=None,
                               action=argparse.BooleanOptionalAction, help=helptext)
        elif typing.get_origin(t) is dict:
            group.add_argument(_flag(name).rstrip("s"), dest=name, metavar="KEY=VALUE",
                               action="append", default=None,
                               help=f"repeatable: {_flag(name).rstrip('s')} key=value")
        else:
            base = t if t in (int, float, str) else str
            group.add_argument(_flag(name), dest=name, type=base, default=None, help=helptext)


def read_toml(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None


def build(cls: type[C], table: dict[str, Any] | None = None,
          args: argparse.Namespace | None = None, *, section: str = "",
          overrides: dict[str, Any] | None = None) -> C:
    """Instantiate ``cls`` from a TOML table, then given flags, then explicit overrides."""
    table = dict(table or {})
    given = {k: v for k, v in vars(args).items() if v is not None} if args else {}
    given.update(overrides or {})
    return _build(cls, table, given, section or cls.__name__)


def _build(cls: type[C], table: dict[str, Any], given: dict[str, Any], where: str) -> C:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    nested = {n for n in names if dataclasses.is_dataclass(hints[n])}
    leaf_names = {n for n, _, _ in _flat_fields(cls)}
    for key in table:
        if key not in names and key not in leaf_names:
            raise ValueError(f"unknown key {key!r} in [{where}]; known: {', '.join(sorted(names))}")
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if f.name in nested:
            sub = dict(table.get(f.name, {}))
            sub_names = {n for n, _, _ in _flat_fields(t)}
            sub.update({k: v for k, v in table.items() if k in sub_names and k not in names})
            kwargs[f.name] = _build(t, sub, given, f"{where}.{f.name}")
            continue
        value = given.get(f.name, table.get(f.name, dataclasses.MISSING))
        if value is dataclasses.MISSING:
            continue
        kwargs[f.name] = _coerce(value, t, f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"[{where}]: {exc}") from None


def _coerce(value: Any, t: Any, where: str) -> Any:
    if typing.get_origin(t) is dict:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        out = {}
        for item in value:
            key, sep, val = str(item).partition("=")
            if not sep:
                raise ValueError(f"{where}: expected KEY=VALUE, got {item!r}")
            out[key.strip()] = val.strip()
        return out
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t in (int, float, str, bool) and not isinstance(value, t):
        raise ValueError(f"{where}: expected {t.__name__}, got {value!r}")
    return value
