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
    JSON file after every task (atomically), for the launcher's table."""

    def __init__(self, inner: Trainer, path: str | Path) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.path = Path(path)
        self.version = -1
        self.tasks = 0

    def on_pull(self, version: int) -> None:
        self.version = version
        self.inner.on_pull(version)

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        t0 = time.perf_counter()
        result = self.inner.train(params, settings, seed=seed)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        self.tasks += 1
        steps = result.metrics.get("steps", 0.0)
        status = {"version": self.version, "tasks": self.tasks,
                  "examples_per_s": round(steps * settings.batch_size / elapsed, 1),
                  "time": time.time()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, self.path)
        return result


__all__ = ["StatusTrainer"]
