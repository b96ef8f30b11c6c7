"""The flat key namespace of a nested config.

People name the server's settings flat: ``--buffer-size 5`` on the command line,
``buffer_size = 5`` in a config file's ``[server]`` table, ``ServerConfig.from_flat(...)`` in
tests and benchmarks; code reads them nested (``config.policy.buffer_size``). This module is
the mapping between the two, kept apart from the config declarations in server/config.py: a
:class:`FlatKeys` over a root dataclass and its sub-config fields lists every flat key, builds
the root's constructor arguments from flat keys and reads them back. It knows nothing of what
the settings mean; server/config.py declares them and checks their values.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

__all__ = ["FlatKeys"]

#: A flat key's place: the root's sub-config field ('' for the root's own), the class that
#: declares the field, and the field.
Entry = tuple[str, type, dataclasses.Field[Any]]


class FlatKeys:
    """The flat keys of dataclass ``root``, whose fields named in ``groups`` hold sub-config
    dataclasses (``groups``: field name -> its class) and are flattened into their fields.

    Two fields of one name would make a flag ambiguous: that is a TypeError here, at import of
    the module that declares the config.
    """

    def __init__(self, root: type, groups: Mapping[str, type]) -> None:
        self.root = root
        self.groups = dict(groups)
        self.entries: dict[str, Entry] = {}
        for f in dataclasses.fields(root):
            sub = self.groups.get(f.name)
            members = [(f.name, sub, g) for g in dataclasses.fields(sub)] if sub \
                else [("", root, f)]
            for group, owner, g in members:
                if g.name in self.entries:
                    raise TypeError(f"flat key {g.name!r} of {root.__name__} is declared twice "
                                    f"({self.entries[g.name][1].__name__}, {owner.__name__})")
                self.entries[g.name] = (group, owner, g)

    def fields(self) -> dict[str, tuple[type, dataclasses.Field[Any]]]:
        """Every flat key, in order, with the class that declares its field."""
        return {key: (owner, f) for key, (_, owner, f) in self.entries.items()}

    def arguments(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The root's constructor arguments for flat ``values``: its own keys as they are,
        the others gathered into their sub-configs (each built, so each checks itself; a
        sub-config none of whose keys is given is built with its defaults). An unknown key is
        a TypeError, with the closest known one as a hint."""
        parts: dict[str, dict[str, Any]] = {"": {}, **{group: {} for group in self.groups}}
        for key, value in values.items():
            if key not in self.entries:
                close = difflib.get_close_matches(key, self.entries, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{self.root.__name__} has no setting {key!r}{hint}")
            parts[self.entries[key][0]][key] = value
        own = parts.pop("")
        return {**own, **{group: self.groups[group](**kw) for group, kw in parts.items()}}

    def values(self, config: Any) -> dict[str, Any]:
        """Every flat key of ``config`` (an instance of the root) with its value."""
        return {key: getattr(getattr(config, group) if group else config, key)
                for key, (group, _, _) in self.entries.items()}
