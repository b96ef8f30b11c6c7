"""What a run leaves behind: metrics.jsonl, summary.json and plots in its output directory."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row as JSON can hold it: non-finite floats become None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


class RunRecorder:
    """Appends one JSON line per global version; writes the summary and plots at the end.

    A resumed run passes the rows it already has (``rows``: the durable state's, or
    ``up_to``: keep the file's rows up to the checkpoint's version), so ``metrics.jsonl``, the
    summary and the plot cover the whole run, and no version appears twice.
    """

    def __init__(self, out_dir: str | Path, *, config: dict[str, Any] | None = None,
                 rows: list[dict[str, Any]] | None = None, up_to: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.config = config or {}
        if rows is None and up_to is not None:
            rows = [r for r in read_rows(self.metrics_path) if r.get("version", 0) <= up_to]
        #: The last row and the best accuracy so far: what the summary needs, kept as the run
        #: goes (every row stays on disk only, so a server's memory does not grow per version).
        self.last: dict[str, Any] = {}
        self.best_accuracy: float | None = None
        self.count = 0
        #: Entries a run's stages add to summary.json (the DP stage's ``privacy``).
        self.notes: dict[str, Any] = {}
        if rows is not None:  # rewrite the file from the rows, atomically
            tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows),
                           encoding="utf-8")
            os.replace(tmp, self.metrics_path)
            for r in rows:
                self._note(r)
        self._file = self.metrics_path.open("a", encoding="utf-8")

    def _note(self, row: dict[str, Any]) -> None:
        self.last = row
        self.count += 1
        acc = row.get("accuracy")
        if acc is not None and (self.best_accuracy is None or acc > self.best_accuracy):
            self.best_accuracy = acc

    def record(self, row: dict[str, Any]) -> None:
        clean = clean_row(row)
        self._note(clean)
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row so far, read back from metrics.jsonl."""
        if not self._file.closed:
            self._file.flush()
        return read_rows(self.metrics_path)

    def finish(self, extra: dict[str, Any] | None = None, *, plot: bool = True) -> dict[str, Any]:
        """Write summary.json (and the plots); return the summary."""
        self._file.close()
        last = self.last
        summary: dict[str, Any] = {
            "versions": last.get("version", 0),
            "final_accuracy": last.get("accuracy"),
            "final_loss": last.get("loss"),
            "best_accuracy": self.best_accuracy,
            "time_s": last.get("time_s", 0.0),
            "updates": last.get("updates", 0),
            "bytes_up": last.get("bytes_up", 0),
            "bytes_down": last.get("bytes_down", 0),
            "refused": last.get("refused", {}),  # by gRPC status
            "refused_by_reason": last.get("refused_by_reason", {}),  # by "STATUS: reason"
            "config": self.config,
        }
        summary.update(self.notes)
        summary.update(extra or {})
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True,
                                                              default=str))
        if plot and self.count:
            try:
                title, virtual = plot_labels(self.config, self.out_dir)
                plot_run(self.rows, self.out_dir / "accuracy.png", title=title,
                         virtual=virtual)
            except Exception:  # a missing plot must not lose a finished run's results
                log.exception("could not draw the accuracy plot")
        return summary


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file (a torn last line, from a crash, is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_labels(config: dict[str, Any], out_dir: Path) -> tuple[str, bool]:
    """A run's plot title (the command, the mode, the run's directory) and whether its time
    is virtual (a simulation's), from the config its summary records."""
    if "simulation" in config:
        command, virtual = "simulate", True
    elif "run" in config:
        command, virtual = "run", False
    else:
        command, virtual = "server", False
    if "gossip" in config:
        mode = f"gossip ({config['gossip'].get('topology', '')})".replace(" ()", "")
    else:
        mode = f"{config.get('server', {}).get('mode', 'sync')} mode"
    return f"murmura {command}: {mode}, {out_dir.name}", virtual


def plot_run(rows: list[dict[str, Any]], path: Path, *, title: str = "Murmura run",
             virtual: bool = False) -> None:
    """Accuracy against time and against cumulative uplink bytes, side by side.

    Virtual time (a simulation's) is plotted as it is; wall-clock time from the first
    version, so start-up (processes starting, torch importing) does not stretch the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = [r.get("accuracy") for r in rows]
    t = [r.get("time_s", 0.0) for r in rows]
    if not virtual and t:
        t = [x - t[0] for x in t]
    up = [r.get("bytes_up", 0) / 1e6 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(t, acc, marker=".")
    axes[0].set_xlabel("virtual seconds" if virtual else "seconds since the first version")
    axes[1].plot(up, acc, marker=".")
    axes[1].set_xlabel("cumulative uplink (MB)")
    for ax in axes:
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
