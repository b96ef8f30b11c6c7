"""What every Murmura benchmark shares: arguments, timing, memory probes and the report.

A benchmark script builds a :class:`Report`, adds its tables, targets and plots, and calls
:meth:`Report.finish`, which

* prints the tables and targets as markdown on stdout (progress goes to stderr, see
  :func:`progress`);
* writes ``benchmarks/results/<name>.json``;
* replaces the script's own section of ``benchmarks/RESULTS.md``, delimited by
  ``<!-- BEGIN <name> -->`` / ``<!-- END <name> -->`` (appended when missing).

Under ``--smoke`` a script runs the same code at toy sizes, to prove in seconds that it still
works (CI runs every script so, ``tests/benchmarks/test_smoke.py``); its figures mean nothing,
so it writes ``<name>.json`` and its plots to a scratch directory (``--smoke-dir``) and never
touches ``results/`` or ``RESULTS.md``.

Targets are always computed from measured values (:meth:`Report.target`); a missed target is
reported as missed, never hidden. Peers are timed in the same run, interleaved with ours, and
the best of several repetitions is kept (:func:`interleaved`), because the benchmark machine is
small and shared.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime as _dt
import fcntl
import gc
import json
import os
import platform
import re
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
RESULTS_MD_HEADER = (
    "# Murmura benchmark results\n\n"
    "Each section below is written by the script named in it and replaced when that script "
    "runs again; do not edit between the markers by hand. `README.md` says how to run them.\n"
)

# -- command line and progress ---------------------------------------------------------------


def parse_args(name: str, description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The flags every benchmark takes (``--quick``, ``--smoke``, ``--no-save``) plus any
    ``extra`` ones."""
    parser = argparse.ArgumentParser(prog=f"python benchmarks/{name}.py", description=description)
    parser.add_argument("--quick", action="store_true",
                        help="same targets at reduced size; finishes in under a minute")
    parser.add_argument("--smoke", action="store_true",
                        help="run the same measurement code at toy sizes in seconds to prove the "
                             "script still works; the figures mean nothing. Writes "
                             f"{name}.json and plots to --smoke-dir only, never results/ or "
                             "RESULTS.md")
    parser.add_argument("--smoke-dir", type=Path, default=None, metavar="DIR",
                        help="where --smoke writes its JSON and plots (created if missing; "
                             "default: a new temporary directory, named on stderr)")
    parser.add_argument("--no-save", action="store_true",
                        help="print only; leave results/ and RESULTS.md untouched")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    if args.smoke and args.quick:
        parser.error("--smoke and --quick are exclusive: pick one size")
    if args.smoke_dir is not None and not args.smoke:
        parser.error("--smoke-dir only applies with --smoke")
    global _SCRATCH_PLOTS, _SMOKE_DIR
    if args.smoke:
        import tempfile

        _SMOKE_DIR = args.smoke_dir or Path(tempfile.mkdtemp(prefix=f"murmura-{name}-smoke-"))
        _SMOKE_DIR.mkdir(parents=True, exist_ok=True)
        _SCRATCH_PLOTS = _SMOKE_DIR
        progress(f"smoke run: toy sizes, figures mean nothing; output goes to {_SMOKE_DIR}")
    elif args.no_save:  # plots too: a --no-save run must not replace the committed PNGs
        import tempfile

        _SCRATCH_PLOTS = Path(tempfile.mkdtemp(prefix=f"murmura-{name}-plots-"))
    return args


#: Where plots go instead of results/ after ``--no-save`` or ``--smoke`` (set by
#: :func:`parse_args`).
_SCRATCH_PLOTS: Path | None = None
#: Under ``--smoke``: where :meth:`Report.finish` writes the JSON instead of results/.
_SMOKE_DIR: Path | None = None


_T0 = time.perf_counter()


def progress(message: str) -> None:
    """One progress line on stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- machine ---------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_total_gb() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPUs, memory, load at start, library versions."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_gb": _memory_total_gb(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for dist in ("numpy", "torch", "flwr", "grpcio", "protobuf"):
        info[dist] = _version(dist)
    try:
        import torch
    except ImportError:
        pass
    else:
        info["torch_threads"] = torch.get_num_threads()
    return info


def describe_machine(info: Mapping[str, Any]) -> str:
    return (f"{info['cpus_usable'] or info['cpu_count']} CPUs ({info['cpu_model']}), "
            f"{info['memory_gb']} GB, load {info['load_avg_at_start'][0]} at start; "
            f"Python {info['python']}, numpy {info['numpy']}, torch {info['torch']}, "
            f"flwr {info['flwr']}, grpcio {info['grpcio']}")


# -- timing ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_once(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds one call of ``fn`` took (garbage collection paused), and what it returned."""
    with _gc_paused():
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, out


def interleaved(cases: Mapping[str, Callable[[], Any]], *, repeats: int,
                check: Callable[[str, Any], None] | None = None,
                label: str = "") -> dict[str, list[float]]:
    """Time every case ``repeats`` times, one round of all cases after another.

    The order rotates from round to round so no case always runs first (or right after the
    most memory-hungry one). ``check(name, output)`` sees each case's output in the first
    round only. Returns every time in seconds; take ``min`` for the best of the repetitions.
    """
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            dt, out = time_once(cases[n])
            times[n].append(dt)
            if check is not None and r == 0:
                check(n, out)
            del out
        progress(f"{label} round {r + 1}/{repeats}: "
                 + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names))
    return times


# -- memory ----------------------------------------------------------------------------------


def _status_kb(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def rss_probe_available() -> bool:
    """True where the kernel lets a process reset its peak RSS (Linux ``clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status_kb("VmHWM")
    except (OSError, KeyError):
        return False
    return True


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _release_freed_heap(mmap_threshold: int = 1 << 20) -> None:
    """Make freed memory leave RSS, so a later peak is not hidden by reused heap.

    glibc raises its mmap threshold as large blocks are freed (up to 32 MiB) and then keeps
    freed arrays in the heap, where the next allocation reuses pages that are already resident.
    Fixing the threshold sends every block of ``mmap_threshold`` bytes or more to its own mmap
    (unmapped on free), and ``malloc_trim`` returns the pages already free. This changes the
    allocator for the rest of the process: run memory probes after the timings.
    """
    name = ctypes.util.find_library("c")
    if not name or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(name)
    libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    libc.malloc_trim(0)


def peak_rss_delta(fn: Callable[[], Any]) -> int | None:
    """Bytes by which the process's peak RSS during ``fn()`` exceeded its RSS before it.

    Memory already resident (the inputs) does not count; everything ``fn`` allocates and
    touches does, whoever allocates it (numpy, torch, gRPC). None where unsupported. See
    :func:`_release_freed_heap` for the allocator setting this needs.
    """
    if not rss_probe_available():
        return None
    with _gc_paused():
        _release_freed_heap()
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        before = _status_kb("VmRSS")
        out = fn()
        peak = _status_kb("VmHWM")
    del out
    return max(peak - before, 0) * 1024


def peak_traced_delta(fn: Callable[[], Any]) -> int:
    """Bytes of Python and numpy allocations alive at the peak of ``fn()`` beyond those before.

    Deterministic (allocator-level), but blind to memory torch allocates for itself.
    """
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del out
    return max(peak - base, 0)


# -- the report ------------------------------------------------------------------------------

Format = str | Callable[[Any], str]


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: Format = "{}"

    def render(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "–"
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


@dataclass(frozen=True)
class Target:
    """A goal checked against a measured value."""

    name: str
    value: float
    goal: str
    met: bool
    op: str
    threshold: float
    unit: str = ""
    detail: str = ""


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda v, t: v >= t,
    "<=": lambda v, t: v <= t,
}


def markdown_table(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(c.render(r) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _fmt_value(v: float, unit: str) -> str:
    text = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}".rstrip()


@dataclass
class Report:
    """Collects one benchmark run's results and writes them out (see the module docstring)."""

    name: str
    quick: bool
    params: dict[str, Any] = field(default_factory=dict)
    smoke: bool = field(default_factory=lambda: _SMOKE_DIR is not None)
    machine: dict[str, Any] = field(default_factory=machine_info)
    command: str = ""
    date: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc)
                      .strftime("%Y-%m-%d %H:%M UTC"))
    rows: list[dict[str, Any]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    footnotes: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    _tables: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.command:
            script = Path(sys.argv[0])
            with contextlib.suppress(ValueError):
                script = script.resolve().relative_to(BENCH_DIR.parent)
            self.command = " ".join(["python", str(script), *sys.argv[1:]])

    def table(self, title: str, columns: Sequence[Column], rows: Sequence[dict[str, Any]]
              ) -> None:
        """Add a table; its rows also go into the JSON, tagged with ``table: title``."""
        self._tables.append((title, markdown_table(columns, rows)))
        self.rows += [{"table": title, **r} for r in rows]

    def target(self, name: str, value: float, op: str, threshold: float, *, unit: str = "",
               detail: str = "") -> Target:
        """Check ``value op threshold`` and record the outcome."""
        t = Target(name=name, value=float(value), goal=f"{op} {_fmt_value(threshold, unit)}",
                   met=bool(_OPS[op](value, threshold)), op=op, threshold=float(threshold),
                   unit=unit, detail=detail)
        self.targets.append(t)
        return t

    def note(self, text: str, *, after_tables: bool = False) -> None:
        """A paragraph under the heading, or after the targets with ``after_tables``."""
        (self.footnotes if after_tables else self.notes).append(text)

    def plot_path(self, suffix: str = "") -> Path:
        """Where to save a PNG (``results/<name><suffix>.png``); it is linked in RESULTS.md.
        Under ``--no-save`` it is a scratch folder's, so the committed plots stay as they are."""
        path = (_SCRATCH_PLOTS or RESULTS_DIR) / f"{self.name}{suffix}.png"
        self.plots.append(path)
        return path

    # -- output ---------------------------------------------------------------------------

    def targets_markdown(self) -> str:
        cols = [Column("name", "target"), Column("measured", "measured"),
                Column("goal", "goal"), Column("met", "met")]
        rows = [{"name": t.name + (f" ({t.detail})" if t.detail else ""),
                 "measured": _fmt_value(t.value, t.unit), "goal": t.goal,
                 "met": "**met**" if t.met else "**NOT met**"} for t in self.targets]
        return markdown_table(cols, rows)

    def markdown(self, *, heading_level: int = 2) -> str:
        h = "#" * heading_level
        mode = " (smoke: toy sizes, the figures mean nothing)" if self.smoke else \
            " (quick)" if self.quick else ""
        parts = [f"{h} {self.name}{mode}",
                 f"`{self.command}` — {self.date}; {describe_machine(self.machine)}."]
        parts += self.notes
        for title, table in self._tables:
            parts += [f"{h}# {title}", table]
        if self.targets:
            missed = sum(not t.met for t in self.targets)
            verdict = "all met" if not missed else f"{missed} of {len(self.targets)} NOT met"
            parts += [f"{h}# Targets ({verdict})", self.targets_markdown()]
        parts += self.footnotes
        for p in self.plots:
            if p.exists():
                parts.append(f"![{p.stem}]({_where(p)})")
        return "\n\n".join(parts) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "quick": self.quick,
            "smoke": self.smoke,
            "command": self.command,
            "date": self.date,
            "machine": self.machine,
            "params": self.params,
            "rows": self.rows,
            "targets": [asdict(t) for t in self.targets],
            "notes": self.notes + self.footnotes,
            "plots": [_where(p) for p in self.plots if p.exists()],
        }

    def finish(self, *, save: bool = True) -> int:
        """Print the report; unless ``save`` is false, write the JSON and the RESULTS.md
        section. Under ``--smoke`` the JSON goes to the smoke directory whatever ``save``
        says, and nothing else is written. Returns 0 (a missed target is a result, not a
        failure of the script)."""
        text = self.markdown()
        print(text, flush=True)
        if _SMOKE_DIR is not None:
            out = _SMOKE_DIR / f"{self.name}.json"
            _atomic_write(out, json.dumps(self.to_json(), indent=2, default=_json_default) + "\n")
            progress(f"smoke run: wrote {out} (results/ and RESULTS.md untouched)")
        elif save:
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            out = RESULTS_DIR / f"{self.name}.json"
            _atomic_write(out, json.dumps(self.to_json(), indent=2, default=_json_default) + "\n")
            update_section(self.name, text)
            progress(f"wrote {out.relative_to(BENCH_DIR.parent)} and the {self.name!r} section "
                     f"of {RESULTS_MD.relative_to(BENCH_DIR.parent)}")
        return 0


def _where(path: Path) -> str:
    """A plot's path as RESULTS.md and the JSON name it: relative to benchmarks/ when it is
    inside it (results/), absolute otherwise (a scratch directory)."""
    return path.relative_to(BENCH_DIR).as_posix() if path.is_relative_to(BENCH_DIR) else \
        path.as_posix()


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return o.as_posix()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def update_section(name: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace ``name``'s section of RESULTS.md (or append it), leaving the rest untouched.

    Holds an exclusive lock on the file itself while it reads and rewrites it in place, so
    benchmarks finishing at the same time do not lose each other's sections.
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    section = f"{begin}\n{body.rstrip()}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        text = f.read() or RESULTS_MD_HEADER
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        if pattern.search(text):
            text = pattern.sub(lambda _: section, text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
        f.seek(0)
        f.truncate()
        f.write(text)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


__all__ = [
    "BENCH_DIR",
    "RESULTS_DIR",
    "RESULTS_MD",
    "Column",
    "Report",
    "Target",
    "describe_machine",
    "interleaved",
    "machine_info",
    "markdown_table",
    "parse_args",
    "peak_rss_delta",
    "peak_traced_delta",
    "progress",
    "pyplot",
    "rss_probe_available",
    "time_once",
    "update_section",
]
