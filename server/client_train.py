"""Clients' training metrics in the metrics rows (opt-in: a Flower app's run turns it on).

An update's metrics map carries what the client's trainer measured (a Flower app's
``train_loss``, any metric its train handler returns). With a :class:`ClientTrainMetrics` on
the core, each row gets, per metric name, ``client_train_<name>_mean``: the mean over the
updates that went into the version, weighted by their ``num_examples`` as Flower's FedAvg
weighs them (a leading ``train_`` is dropped from the name: ``train_loss`` gives
``client_train_loss_mean``), and ``client_train_updates``. Evaluation reports (``eval_*``,
server/client_eval.py) are left to that module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Bounds on a value, so no client can push a mean to overflow (as for evaluation reports).
MAX_VALUE = 1e30


class ClientTrainMetrics:
    """Training metrics of the updates since the last row (owned by the core's thread)."""

    def __init__(self) -> None:
        self._entries: list[tuple[dict[str, float], int]] = []

    def add(self, metrics: Mapping[str, float], num_examples: int) -> object:
        """Keep one update's metrics; returns a token for :meth:`discard`."""
        kept = {k: float(v) for k, v in metrics.items()
                if not k.startswith("eval_") and math.isfinite(v) and abs(v) <= MAX_VALUE}
        entry = (kept, max(int(num_examples), 1))
        self._entries.append(entry)
        return entry

    def discard(self, token: object) -> None:
        """Take back an update that was refused after all."""
        for i, entry in enumerate(self._entries):
            if entry is token:
                del self._entries[i]
                return

    def flush(self) -> dict[str, object]:
        """The row's fields for the updates since the last flush (none without updates)."""
        entries, self._entries = self._entries, []
        if not entries:
            return {}
        row: dict[str, object] = {"client_train_updates": len(entries)}
        for name in sorted({k for m, _ in entries for k in m}):
            have = [(m[name], n) for m, n in entries if name in m]
            total = sum(n for _, n in have)
            row[f"client_train_{name.removeprefix('train_')}_mean"] = \
                sum(v * n for v, n in have) / total
        return row


__all__ = ["ClientTrainMetrics"]
