"""What a simulation reports: its counters, summary.json, the plots and the result object."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.protocols import FlatVector
from murmura.simulation.execution import default_workers

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """What a simulation produced: the summary (as in summary.json) and the final model."""

    summary: dict[str, Any]
    params: FlatVector
    version: int
    rows: list[dict[str, Any]]
    execution_path: str
    virtual_s: float
    wall_s: float
    staleness: dict[int, int]
    out_dir: Path | None = None

    @property
    def final_accuracy(self) -> float | None:
        return self.summary.get("final_accuracy")


class ResultsJob:
    """The engine's reporting (mixed into :class:`~murmura.simulation.engine.Simulation`)."""

    if TYPE_CHECKING:  # the engine's state, typed where Simulation declares it
        def __getattr__(self, name: str) -> Any: ...

    def stats(self) -> dict[str, Any]:
        """The run's counters (the ``simulation`` entry of summary.json)."""
        virtual = self.clock.now
        updates = self.core.traffic.updates
        wall = self._wall
        return {
            "clients": self.sim.clients,
            "execution_path": self.execution_path,
            "execution": self.executor.describe(),
            # where training ran, and the clients one batch there trained (0: not batched)
            "device": getattr(self.executor, "device_name", "cpu"),
            "chunk_size": getattr(self.executor, "chunk_size", 0),
            "probe": self.probe_note,
            "torch_threads": self.sim.threads or default_workers(),
            "data": self.data.source,
            "virtual_s": virtual,
            "wall_s": wall,
            "train_wall_s": self.train_wall_s,
            "speedup_vs_real_time": virtual / wall if wall else None,
            "updates": updates,
            "updates_per_wall_s": updates / wall if wall else None,
            "events": self.events,
            "training_batches": self.batches,
            "mean_batch": self.batched_jobs / self.batches if self.batches else 0.0,
            "lost_to_dropout": self.lost,
            "refused": dict(self.refused),
            "gave_up": self.gave_up,
            "attackers": len(self.attacks),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "done": self.core.done,
        }

    def finish(self, *, plot: bool = True) -> SimulationResult:
        """Write summary.json and the plots (when there is an output directory)."""
        self.executor.close()
        stats = self.stats()
        recorder = self.core.recorder
        if recorder is not None:
            summary = recorder.finish({"wall_s": stats["wall_s"], "simulation": stats},
                                      plot=plot)
            rows = recorder.rows
            if plot and (self.core.config.mode == "async" or len(self.staleness) > 1):
                try:
                    plot_staleness(self.staleness, recorder.out_dir / "staleness.png")
                except Exception:  # a missing plot must not lose a finished run
                    log.exception("could not draw the staleness histogram")
        else:
            rows = self.rows
            last = rows[-1] if rows else {}
            summary = {"versions": self.core.version, "final_accuracy": last.get("accuracy"),
                       "final_loss": last.get("loss"), "time_s": last.get("time_s", 0.0),
                       "updates": self.core.traffic.updates,
                       "bytes_up": self.core.traffic.bytes_up,
                       "bytes_down": self.core.traffic.bytes_down,
                       "wall_s": stats["wall_s"], "simulation": stats}
        return SimulationResult(summary=summary, params=self.core.params.copy(),
                                version=self.core.version, rows=list(rows),
                                execution_path=self.execution_path,
                                virtual_s=stats["virtual_s"], wall_s=stats["wall_s"],
                                staleness=dict(self.staleness), out_dir=self.out_dir)


def plot_staleness(hist: dict[int, int] | Counter[int], path: Path) -> None:
    """Bar chart: how many accepted updates had each staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(hist)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(keys, [hist[k] for k in keys], color="tab:blue")
    ax.set_xlabel("staleness (versions behind when the update arrived)")
    ax.set_ylabel("accepted updates")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["ResultsJob", "SimulationResult", "plot_staleness"]
