"""CPU time of processes and threads from Linux /proc, for the benchmarks that split a
server's CPU between its gateway, its threads and the worker processes it started."""

from __future__ import annotations

import os


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc ``stat`` file after the command name (None if it is gone)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int | str, tid: int | str | None = None) -> float:
    """utime + stime of process ``pid`` (all its threads, not its children), or of its thread
    ``tid`` alone; ``pid`` may be ``"self"``."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = stat_fields(path)
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def tree_cpu_seconds(pid: int, *, include_root: bool = True) -> float:
    """CPU seconds of ``pid``'s descendants (and of ``pid`` itself unless told not to), live
    or reaped: a process's cutime + cstime carry the children it reaped (a worker that exited
    was reaped by the forkserver), so nothing is lost when one stops."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(f"/proc/{entry}/stat")
        if fields is None:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    total = 0.0
    todo = [pid] if include_root else [c for c, p in parents.items() if p == pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += [c for c, pp in parents.items() if pp == p]
    return total


__all__ = ["cpu_seconds", "stat_fields", "tree_cpu_seconds"]
