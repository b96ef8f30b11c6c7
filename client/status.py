"""A client's progress in a small JSON file, for ``murmura launch``'s status table."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from murmura.client.trainer import Trainer, TrainResult
from murmura.protocols import FlatVector, TaskSettings


class StatusTrainer(Trainer):
    """Wraps a trainer and writes ``{"version", "tasks", "examples_per_s", "time"}`` to a
    JSON file (atomically) for the launcher's table: when a task starts (the version it
    trains on: a first task that trains for minutes is not shown as "-"), when it ends, and
    with ``"done"`` when the run is over (:func:`finish_status`, at the server's last
    version)."""

    def __init__(self, inner: Trainer, path: str | Path) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.path = Path(path)
        self.version = -1
        self.tasks = 0
        self.examples_per_s: float | None = None

    def on_pull(self, version: int) -> None:
        self.version = version
        self.inner.on_pull(version)
        self._write()

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        t0 = time.perf_counter()
        result = self.inner.train(params, settings, seed=seed)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        self.tasks += 1
        steps = result.metrics.get("steps", 0.0)
        self.examples_per_s = round(steps * settings.batch_size / elapsed, 1)
        self._write()
        return result

    def _write(self) -> None:
        _write(self.path, {"version": self.version, "tasks": self.tasks,
                           "examples_per_s": self.examples_per_s, "time": time.time()})


def finish_status(path: str | Path, version: int) -> None:
    """Mark a status file done: the run is over at global ``version`` (the server's last,
    named by its stop), which the table then shows instead of the last version trained on."""
    try:
        status = dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        status = {"tasks": 0, "examples_per_s": None}
    status.update(version=max(int(status.get("version", -1)), version), done=True,
                  time=time.time())
    _write(Path(path), status)


def _write(path: Path, status: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


__all__ = ["StatusTrainer", "finish_status"]
