"""Config dataclasses from TOML files and command-line flags, one-to-one with their fields.

Precedence: field defaults < the TOML file's table < flags given on the command line. A nested
dataclass field (``ServerConfig.train``) reads from its own sub-table (``[server.train]``) or
from flat keys in the parent table; on the command line its fields appear without a prefix.
A config that names its keys itself (``flat_fields()``, built with ``from_flat(**keys)``:
ServerConfig, whose sub-configs are written flat) is read by those keys.
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


def _keys(cls: type) -> list[tuple[type, str, Any, dataclasses.Field[Any]]]:
    """(declaring class, name, type, field) for each key of a table for ``cls``: its fields,
    or the keys it names itself (``flat_fields``)."""
    flat = getattr(cls, "flat_fields", None)
    if flat is None:
        hints = _hints(cls)
        return [(cls, f.name, hints[f.name], f) for f in dataclasses.fields(cls)]
    return [(owner, name, _hints(owner)[name], f) for name, (owner, f) in flat().items()]


def _nested(t: Any) -> bool:
    """Whether a field of type ``t`` is a nested config (a sub-table, its keys also flat)."""
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _make(cls: type[C], kwargs: dict[str, Any]) -> C:
    """``cls`` from its keys: ``from_flat`` for a config that names its keys, else ``cls``."""
    make = getattr(cls, "from_flat", cls)
    return make(**kwargs)


def _flat_fields(cls: type) -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    """(name, type, field) for every leaf field, nested dataclasses flattened."""
    return [(name, t, f) for _, name, t, f in _owned_fields(cls)]


def _owned_fields(cls: type) -> list[tuple[type, str, Any, dataclasses.Field[Any]]]:
    """(declaring class, name, type, field) for every leaf key, nested dataclasses
    flattened."""
    out = []
    for owner, name, t, f in _keys(cls):
        if _nested(t):
            out.extend(_owned_fields(t))
        else:
            out.append((owner, name, t, f))
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown_default(f: dataclasses.Field[Any], t: Any) -> str:
    """A field's default as ``--help`` shows it."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if t is bool:
        return "on" if value else "off"
    if value in ("", {}, None):
        return "none"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str,
                  skip: tuple[str, ...] = ()) -> None:
    """One flag per leaf field of ``cls``; defaults stay None so given flags can be told apart.

    Each flag's help is the field's ``metadata["help"]`` or its line in
    :mod:`murmura.helptext`, then the field's default.
    """
    from murmura.helptext import field_help

    group = parser.add_argument_group(title)
    taken = {a.dest for a in parser._actions}
    for owner, name, t, f in _owned_fields(cls):
        if name in skip or name in taken:  # a shared name (e.g. seed) is one flag for both
            continue
        taken.add(name)
        text = f.metadata.get("help") or field_help(owner.__name__, name) or ""
        if "default" not in text:
            text = f"{text} (default: {_shown_default(f, t)})".lstrip()
        text = text.replace("%", "%%")  # argparse formats help with %
        if t is bool:
            group.add_argument(_flag(name), dest=name, default=None,
                               action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(t) is dict:
            flag = _flag(name).rstrip("s")
            group.add_argument(flag, dest=name, metavar="KEY=VALUE", action="append",
                               default=None, help=f"repeatable: {text}")
        else:
            base = t if t in (int, float, str) else str
            metavar = {int: "N", float: "X"}.get(base, name.upper())
            group.add_argument(_flag(name), dest=name, type=base, default=None, help=text,
                               metavar=metavar)


def known_keys(cls: type) -> tuple[set[str], dict[str, type]]:
    """The keys a table for ``cls`` may hold (its fields, and its nested dataclasses' fields
    written flat), and the nested dataclasses by field name (their own sub-tables)."""
    own = _keys(cls)
    nested = {name: t for _, name, t, _ in own if _nested(t)}
    keys = {name for _, name, _, _ in own} | {n for n, _, _ in _flat_fields(cls)}
    return keys, nested


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
    kwargs: dict[str, Any] = {}
    own = _keys(cls)
    names = {name for _, name, _, _ in own}
    leaf_names = {n for n, _, _ in _flat_fields(cls)}
    for key in table:
        if key not in names and key not in leaf_names:
            raise ValueError(f"unknown key {key!r} in [{where}]; known: {', '.join(sorted(names))}")
    for _, name, t, _ in own:
        if _nested(t):
            sub = dict(table.get(name, {}))
            sub_names = {n for n, _, _ in _flat_fields(t)}
            sub.update({k: v for k, v in table.items() if k in sub_names and k not in names})
            kwargs[name] = _build(t, sub, given, f"{where}.{name}")
            continue
        value = given.get(name, table.get(name, dataclasses.MISSING))
        if value is dataclasses.MISSING:
            continue
        kwargs[name] = _coerce(value, t, f"{where}.{name}")
    try:
        return _make(cls, kwargs)
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
