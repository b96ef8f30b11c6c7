"""Rule and codec options given as text (``--defense-option f=2``, a config file's strings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def parse_option(value: str) -> Any:
    """An option's text as the value it names: an int, else a float, else the text;
    ``none`` (any case) is None."""
    text = str(value).strip()
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(options: Mapping[str, str]) -> dict[str, Any]:
    """Every option parsed (:func:`parse_option`), its key as a Python name (``-`` → ``_``)."""
    return {key.replace("-", "_"): parse_option(value) for key, value in options.items()}


__all__ = ["parse_option", "parse_options"]
