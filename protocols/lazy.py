"""Names a package exports but imports only when first used (PEP 562).

The command line's parser needs a few config classes; importing a package whose ``__init__``
imports everything would pull in torch for ``murmura --help``. A package lists where each of
its names lives and gets a module ``__getattr__`` that imports the name's module on first use
and keeps the value in the package's namespace, so later lookups are plain attribute reads.
(``tasks``, which may import nothing else from the project, keeps its own copy.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, where: Mapping[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``where`` maps each lazy name to its module, and
    ``namespace`` is the package's ``globals()``, where a name's value stays once imported."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


__all__ = ["lazy_getattr"]
