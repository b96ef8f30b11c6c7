"""A one-line progress bar for long runs (stderr); plain lines when not on a terminal. And the
one line that ends a run (:func:`result_line`), the same for ``murmura run`` and ``server``."""

from __future__ import annotations

import sys
import time
from collections.abc import Hashable
from typing import Any, TextIO

__all__ = ["Progress", "result_line"]


class Progress:
    """Start-up status, then one bar per global version.

    On a terminal one line is rewritten in place; otherwise a line is written per change
    (start-up lines at most every ``every_s`` seconds, and on the last change). ``quiet``
    writes nothing (``-q``).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 24,
                 quiet: bool = False, every_s: float = 2.0) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.quiet = quiet
        self.every_s = every_s
        self.tty = self.stream.isatty()
        self._last = -1
        self._start_key: Hashable = None
        self._start_at = -float("inf")
        self._open = False  # a terminal line is waiting for its newline

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(100))
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def starting(self, text: str, *, key: Hashable = None, elapsed: float = 0.0) -> None:
        """Before the first version: ``text`` (e.g. clients running and joined), written when
        ``key`` changes (throttled off a terminal) or, on a terminal, as the time moves."""
        if self.quiet or self._last >= 0:
            return
        now = time.monotonic()
        changed = key != self._start_key
        if not self.tty and (not changed or now - self._start_at < self.every_s):
            return
        if not changed and now - self._start_at < 0.5:
            return
        self._start_key, self._start_at = key, now
        self._write(f"{text}  {elapsed:.1f}s")

    @property
    def last_version(self) -> int:
        """The last version a line was printed for (0: none yet)."""
        return max(self._last, 0)

    def update(self, row: dict[str, Any]) -> None:
        if self.quiet:
            return
        version = int(row.get("version", 0))
        if version == self._last:
            return
        self._last = version
        filled = int(self.width * min(version, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        acc = row.get("accuracy")
        text = (f"[{bar}] version {version}/{self.total}"
                + (f"  round {row['round']}" if row.get("round") else "")
                + (f"  acc {acc:.3f}" if isinstance(acc, float) else "")
                + f"  updates {row.get('updates', 0)}"
                + (f"  clients {row['clients']}" if row.get("clients") is not None else "")
                + f"  up {row.get('bytes_up', 0) / 1e6:.2f} MB"
                + f"  {row.get('time_s', 0.0):.1f}s")
        self._write(text)

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def result_line(summary: dict[str, Any], last_row: dict[str, Any], wall_s: float) -> str:
    """``final test accuracy A[, perplexity P] after N versions (U updates, M MB up) in S s``
    from a run's summary and its last metrics row; or that no version was published."""
    acc = summary.get("final_accuracy")
    if acc is None:
        return "no version was published"
    ppl = last_row.get("perplexity")  # a language model's (the lm task)
    return (f"final test accuracy {acc:.4f}"
            + (f", perplexity {ppl:.2f}" if isinstance(ppl, float) else "")
            + f" after {summary['versions']} versions ({summary['updates']} updates, "
            f"{summary['bytes_up'] / 1e6:.2f} MB up) in {wall_s:.1f} s")
