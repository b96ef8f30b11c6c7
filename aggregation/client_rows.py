"""Per-client rows of state with a bound on the clients tracked: the storage of the Sybil
scorer's histories and of the collusion screen's residual histories.

Both keep, for each client seen, a few rows (a history sketch, a last update, a tick) and must
stay O(max_clients x dim) memory whatever the population: the least recently observed client
is evicted first, a forgotten client's row is reused, and the arrays grow by doubling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["ClientRows"]


class ClientRows:
    """Named arrays with one row per tracked client (at most ``capacity`` clients).

    ``columns`` maps a name to ``(row shape, dtype, fill)``: a row is set to ``fill`` when a
    client gets it and when it is forgotten. ``arrays[name][row(client_id)]`` is the client's
    row; the arrays are replaced when they grow, so look them up after :meth:`row`.
    """

    def __init__(self, capacity: int,
                 columns: Mapping[str, tuple[tuple[int, ...], type | np.dtype, float]]) -> None:
        self.capacity = int(capacity)
        self._columns = dict(columns)
        self.slots: OrderedDict[str, int] = OrderedDict()  # least recently observed first
        self._free: list[int] = []
        self.arrays: dict[str, np.ndarray] = {
            name: np.zeros((0, *shape), dtype=dtype) for name, (shape, dtype, _) in
            self._columns.items()}

    def row(self, client_id: str) -> int:
        """The client's row, now its most recently observed; a new client gets a fresh row
        (evicting the least recently observed one when full)."""
        slot = self.slots.get(client_id)
        if slot is not None:
            self.slots.move_to_end(client_id)
            return slot
        if len(self.slots) >= self.capacity:
            _, slot = self.slots.popitem(last=False)
        elif self._free:
            slot = self._free.pop()
        else:
            slot = len(self.slots)
            have = next(iter(self.arrays.values())).shape[0] if self.arrays else 0
            if slot >= have:
                grown = min(self.capacity, max(64, 2 * have))
                for name, (shape, dtype, fill) in self._columns.items():
                    extra = np.full((grown - have, *shape), fill, dtype=dtype)
                    self.arrays[name] = np.concatenate([self.arrays[name], extra])
        self._reset(slot)
        self.slots[client_id] = slot
        return slot

    def forget(self, client_id: str) -> None:
        """Drop a client; its row is cleared and reused."""
        slot = self.slots.pop(client_id, None)
        if slot is not None:
            self._reset(slot)
            self._free.append(slot)

    def _reset(self, slot: int) -> None:
        for name, (_, _, fill) in self._columns.items():
            self.arrays[name][slot] = fill

    def rows_of(self) -> np.ndarray:
        """The tracked clients' rows, least recently observed first."""
        return np.fromiter(self.slots.values(), dtype=np.intp, count=len(self.slots))

    def export(self) -> dict[str, np.ndarray]:
        """``ids`` (least recently observed first) and each column's rows for them, copied."""
        rows = self.rows_of()
        out = {name: array[rows].copy() for name, array in self.arrays.items()}
        out["ids"] = np.array(list(self.slots), dtype=str)
        return out

    def load(self, ids: list[str], columns: Mapping[str, np.ndarray]) -> None:
        """Replace everything with ``ids`` and their rows (checked by the caller); only the
        newest ``capacity`` are kept."""
        keep = slice(-self.capacity, None)
        ids = ids[keep]
        self.slots = OrderedDict((cid, i) for i, cid in enumerate(ids))
        self._free = []
        for name, (_, dtype, _) in self._columns.items():
            self.arrays[name] = np.array(columns[name][keep], dtype=dtype, copy=True)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)
