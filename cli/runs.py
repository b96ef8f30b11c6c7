"""``murmura runs``: the runs under a directory, or one run in detail; and :class:`LiveRun`,
what a serving command leaves in its run directory while it runs.

``murmura runs [DIR]`` lists each run directory under DIR (default ``runs``): the command
that made it, its mode, its state, its versions, its final accuracy and when it last changed.
``murmura runs show NAME`` prints one run's config, summary and last metrics rows. The state
comes from the files a run leaves: ``murmura.pid`` (written by :class:`LiveRun` while
``murmura server`` or ``murmura run`` serves, removed when it stops) names a process, so a
run is *running* while that process lives and *crashed* once it is gone; without one a run
with a ``summary.json`` is *finished* (or *interrupted*), anything else *incomplete* (a
simulation still going, or a run that died before it wrote a summary).

Only the standard library is imported at module level: ``murmura runs`` answers at once
(no torch), and listing a directory reads at most the tail of each metrics file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from murmura.validate import UsageError

log = logging.getLogger("murmura")

__all__ = ["PIDFILE", "LiveRun", "cmd_runs", "describe_run", "list_runs", "run_dir"]

#: The file a serving command keeps in its run directory (JSON: pid, command, addresses).
PIDFILE = "murmura.pid"
#: Files that make a directory a run.
RUN_FILES = ("summary.json", "metrics.jsonl", "state.db", PIDFILE)
#: Bytes read from the end of metrics.jsonl for its last rows, and the most of a JSON file
#: read at all (a run directory is not trusted to be small).
TAIL_BYTES = 256 * 1024
MAX_JSON_BYTES = 16 << 20


# -- the live run's marker and metrics endpoint ----------------------------------------------

def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), to tell it from a
    later process that reused its pid; None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    recorded, now = info.get("start_ticks"), _start_ticks(pid)
    return recorded is None or now is None or recorded == now


class LiveRun:
    """A run this process serves: its Prometheus endpoint (if asked for) and the pid file in
    its output directory that ``murmura runs`` reads.

    Made early (the endpoint binds its port at once, so a taken port fails before a task
    loads); :meth:`serving` starts the endpoint and writes the pid file once the service is
    up; :meth:`close` stops both. Without an endpoint or a directory those parts do nothing.
    """

    def __init__(self, out: str | Path | None, command: str, metrics_address: str = "", *,
                 quiet: bool = False) -> None:
        self.out = Path(out) if out is not None else None
        self.command = command
        self.quiet = quiet
        self.endpoint: Any = None
        self.pidfile: Path | None = None
        if metrics_address:
            from murmura.server.config import check_metrics_address

            check_metrics_address(metrics_address, "--metrics-address")
            from murmura.server.prometheus import MetricsEndpoint

            self.endpoint = MetricsEndpoint(metrics_address)

    @property
    def metrics_url(self) -> str:
        return self.endpoint.url if self.endpoint is not None else ""

    def serving(self, address: str, telemetry: Any = None, *, peer: Any = None,
                peer_metrics: Any = None, mode: str = "") -> LiveRun:
        """The service is up on ``address``: serve the metrics of ``telemetry`` (an
        aggregator's) or ``peer`` (a :class:`~murmura.gossip.runtime.PeerRuntime`, with
        ``peer_metrics()`` its last evaluation), and mark the directory as running."""
        if self.endpoint is not None and telemetry is None and peer is None:
            log.warning("no metrics to serve at %s: this command has no aggregator or peer",
                        self.metrics_url)
        elif self.endpoint is not None:
            if peer is not None:
                from murmura.gossip.prometheus import PeerCollector

                collector: Any = PeerCollector(peer, metrics=peer_metrics)
            else:
                from murmura.server.prometheus import AggregatorCollector

                collector = AggregatorCollector(telemetry)
            self.endpoint.start(collector)
            if not self.quiet:
                print(f"murmura {self.command}: Prometheus metrics on {self.metrics_url}",
                      file=sys.stderr, flush=True)
        if self.out is not None:
            info: dict[str, Any] = {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
                                    "command": self.command, "address": address,
                                    "metrics": self.metrics_url, "started_unix": time.time(),
                                    "mode": mode}
            if telemetry is not None:
                run = telemetry.run_info()
                info.update(mode=run["mode"], rule=run["rule"])
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / PIDFILE
            tmp = path.with_name(PIDFILE + ".tmp")
            tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)
            self.pidfile = path
        return self

    def close(self) -> None:
        """Stop the endpoint and remove the pid file (a crash leaves it: ``crashed``)."""
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None
        if self.pidfile is not None:
            self.pidfile.unlink(missing_ok=True)
            self.pidfile = None

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- reading run directories ------------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``; None if it is missing, too large or not an object."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def last_rows(path: Path, n: int) -> list[dict[str, Any]]:
    """The last ``n`` rows of a metrics file, from its last :data:`TAIL_BYTES` (a torn last
    line, from a crash, is skipped)."""
    if n <= 0:
        return []
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - TAIL_BYTES, 0))
            data = f.read(TAIL_BYTES)
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first line is cut
    rows: list[dict[str, Any]] = []
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
            if len(rows) == n:
                break
    return rows[::-1]


def _command(config: dict[str, Any]) -> str:
    """The command that made a run, from the config its summary records."""
    if "simulation" in config:
        return "simulate"
    if "run" in config:
        return "run --gossip" if "gossip" in config else "run"
    return "server" if "server" in config else ""


def _mode(config: dict[str, Any]) -> str:
    if "gossip" in config and isinstance(config["gossip"], dict):
        return f"gossip/{config['gossip'].get('topology', '')}".rstrip("/")
    server = config.get("server")
    return str(server.get("mode", "")) if isinstance(server, dict) else ""


def _modified(path: Path) -> float:
    """The latest change to the run's own files (not its subdirectories)."""
    latest = 0.0
    try:
        with os.scandir(path) as it:
            for entry in it:
                try:
                    if entry.is_file(follow_symlinks=False):
                        latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    continue
    except OSError:
        pass
    return latest


def describe_run(path: Path, *, rows: int = 1) -> dict[str, Any]:
    """What ``murmura runs`` knows of the run in ``path``: its command, mode, state, versions,
    final accuracy and last change, its config and summary, and its last ``rows`` rows."""
    summary = _read_json(path / "summary.json")
    pid = _read_json(path / PIDFILE)
    tail = last_rows(path / "metrics.jsonl", max(rows, 1))
    last = tail[-1] if tail else {}
    config = summary.get("config") if summary is not None else None
    config = config if isinstance(config, dict) else {}
    if pid is not None and _alive(pid):
        state = "running"
    elif pid is not None and not (summary is not None and _mtime(path / "summary.json")
                                  >= _mtime(path / PIDFILE)):
        state = "crashed"
    elif summary is not None:
        state = "interrupted" if summary.get("interrupted") else "finished"
    else:
        state = "incomplete"
    live = state == "running"
    versions = last.get("version") if live or summary is None else summary.get("versions")
    accuracy = last.get("accuracy") if live or summary is None else summary.get(
        "final_accuracy")
    leaf = summary is not None and summary.get("role") == "leaf"  # a leaf's own summary
    return {
        "name": path.name, "dir": str(path),
        "command": _command(config) or ("server --role leaf" if leaf else "")
        or (pid or {}).get("command", ""),
        "mode": _mode(config) or (pid or {}).get("mode", ""),
        "state": state, "versions": versions if versions is not None else 0,
        "accuracy": accuracy, "modified_unix": _modified(path),
        "process": pid, "config": config,
        "summary": {k: v for k, v in (summary or {}).items() if k != "config"},
        "rows": tail[-rows:] if rows > 0 else [],
    }


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _is_run(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and any(
        (path / name).exists() for name in RUN_FILES)


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Every run directory directly under ``root``, most recently changed first."""
    if not root.is_dir():
        raise UsageError(f"{str(root)[:80]} is not a directory (give the directory that "
                         f"holds the runs, e.g. `murmura runs runs/`)")
    runs = [describe_run(p, rows=0) for p in sorted(root.iterdir()) if _is_run(p)]
    return sorted(runs, key=lambda r: r["modified_unix"], reverse=True)


def run_dir(root: Path, name: str) -> Path:
    """``root/name`` for a run's NAME: one path component, a directory directly under
    ``root`` (not a link out of it); anything else is a UsageError."""
    shown = repr(name[:60])
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or (os.sep in name) or (os.altsep is not None and os.altsep in name)):
        raise UsageError(f"run name {shown} must be the name of a directory in "
                         f"{str(root)[:60]} (no path separators, not . or ..); see "
                         f"`murmura runs {str(root)[:60]}`")
    if len(name) > 255:
        raise UsageError(f"run name {shown}... is too long")
    path = root / name
    try:
        inside = path.resolve(strict=True).parent == root.resolve(strict=True)
    except (OSError, RuntimeError):
        inside = False
    if not inside or not path.is_dir():
        raise UsageError(f"no run {shown} in {str(root)[:60]}; `murmura runs "
                         f"{str(root)[:60]}` lists them")
    return path


# -- printing ---------------------------------------------------------------------------------

def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix)) if unix else "-"


def _accuracy(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def _table(runs: list[dict[str, Any]]) -> str:
    head = ("NAME", "COMMAND", "MODE", "STATE", "VERSIONS", "ACCURACY", "MODIFIED")
    body = [(r["name"][:40], r["command"] or "-", r["mode"] or "-", r["state"],
             str(r["versions"]), _accuracy(r["accuracy"]), _when(r["modified_unix"]))
            for r in runs]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in [head, *body])


def _show(run: dict[str, Any]) -> str:
    out = [f"run {run['name']} ({run['dir']}): {run['state']}, "
           f"{run['command'] or 'unknown command'}, {run['mode'] or 'unknown mode'}, "
           f"{run['versions']} versions, final accuracy {_accuracy(run['accuracy'])}, "
           f"last changed {_when(run['modified_unix'])}"]
    if run["process"]:
        p = run["process"]
        out.append(f"process {p.get('pid')} ({p.get('command', '')}) on "
                   f"{p.get('address', '') or '-'}"
                   + (f", metrics {p['metrics']}" if p.get("metrics") else ""))
    out.append("config:")
    out.append(_indent(json.dumps(run["config"], indent=2, sort_keys=True, default=str))
               if run["config"] else "  (none recorded: summary.json is written at the end)")
    out.append("summary:")
    out.append(_indent(json.dumps(run["summary"], indent=2, sort_keys=True, default=str))
               if run["summary"] else "  (no summary.json)")
    out.append(f"last {len(run['rows'])} metrics rows:")
    out.extend(f"  {json.dumps(row, sort_keys=True, default=str)}" for row in run["rows"])
    return "\n".join(out)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def cmd_runs(args: argparse.Namespace) -> int:
    """``murmura runs [DIR]`` or ``murmura runs show NAME [--dir DIR]``."""
    target = list(args.target)
    if target and target[0] == "show":
        if len(target) != 2:
            raise UsageError("usage: murmura runs show NAME [--dir DIR]")
        root = Path(args.dir or "runs")
        run = describe_run(run_dir(root, target[1]), rows=args.rows)
        print(json.dumps(run, indent=2, sort_keys=True, default=str) if args.json
              else _show(run))
        return 0
    if len(target) > 1 or (target and args.dir):
        raise UsageError("usage: murmura runs [DIR] (or: murmura runs show NAME --dir DIR)")
    root = Path(target[0] if target else args.dir or "runs")
    runs = list_runs(root)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k not in ("config", "summary", "rows")}
                          for r in runs], indent=2, default=str))
    elif runs:
        print(_table(runs))
    else:
        print(f"no runs in {root} (a run directory holds summary.json, metrics.jsonl, "
              f"state.db or {PIDFILE})")
    return 0
